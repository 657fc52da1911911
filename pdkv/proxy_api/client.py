"""The client of a pdkv proxy's own HTTP surface: its health, its metrics, its admin API and its OpenAI API.

    with ProxyClient("http://127.0.0.1:8000") as proxy:
        view = proxy.planner()                # PlannerView
        answer = proxy.drain(engine_url)      # DrainAnswer

Every call is one attempt bounded by `timeout` (a completion's by its own). The admin key (argument, else env
PDKV_ADMIN_KEY) goes to /pdkv/* and /metrics only, the API key (argument, else the first of env PDKV_API_KEY) to
/v1/* only. A proxy that cannot be reached raises UnreachableError (TimeoutError_ when a completion outlives its
bound); an error answer raises RemoteError with its status (404: no such request, backend, or planner); an
answer that is not this proxy's messages raises RemoteError too.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from typing import Any, TypeVar

import httpx
import msgspec

from pdkv.errors import RemoteError, TimeoutError_, UnreachableError
from pdkv.metrics import Exposition
from pdkv.proxy_api.messages import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    COMPLETIONS_PATH,
    DRAIN_PATH,
    HEALTH_PATH,
    METRICS_PATH,
    MODELS_PATH,
    PLANNER_PATH,
    REQUESTS_PATH,
    DrainAnswer,
    DrainRequest,
    PlannerView,
    ProxyHealth,
    ProxyTiming,
    error_detail,
)

T = TypeVar("T")
_HINT = "is `pdkv proxy` (or `pdkv up`) running there?"


def admin_headers(admin_key: str | None = None) -> dict[str, str]:
    """Headers pdkv's own tools send to a proxy's /pdkv/* and /metrics: the admin key from the flag or env."""
    key = admin_key or os.environ.get(ADMIN_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def api_headers(api_key: str | None = None) -> dict[str, str]:
    """Headers pdkv's own tools send to a proxy's /v1/*: the key given, else the first of env PDKV_API_KEY."""
    key = api_key or next((k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()), None)
    return {"Authorization": f"Bearer {key}"} if key else {}


class ProxyClient:
    """Blocking client (httpx). A context manager; `close()` releases its connections."""

    def __init__(self, url: str, *, timeout: float = 2.0, admin_key: str | None = None, api_key: str | None = None) -> None:
        url = url.strip().rstrip("/")
        self.url = url if "://" in url else f"http://{url}"
        self.timeout = timeout
        self._admin, self._api = admin_headers(admin_key), api_headers(api_key)
        self._http = httpx.Client(base_url=self.url, timeout=timeout, trust_env=False)

    def _headers(self, path: str) -> dict[str, str]:
        return self._admin if path.startswith(("/pdkv/", METRICS_PATH)) else self._api if path.startswith("/v1/") else {}

    def _send(self, method: str, path: str, *, body: Any = None, params: dict[str, str] | None = None,
              headers: dict[str, str] | None = None, timeout: float | None = None) -> httpx.Response:  # fmt: skip
        content = None if body is None else msgspec.json.encode(body)
        sent = {**self._headers(path), **(headers or {}), **({"Content-Type": "application/json"} if content else {})}
        try:
            return self._http.request(method, path, content=content, params=params, headers=sent,
                                      timeout=self.timeout if timeout is None else timeout)  # fmt: skip
        except httpx.TimeoutException as exc:
            if timeout is None:  # a short call: the proxy is not answering
                raise UnreachableError(f"proxy {self.url} did not answer {method} {path} within {self.timeout:g} s (unreachable)",
                                       hint=_HINT) from exc
            raise TimeoutError_(f"no answer through {self.url} within {timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise UnreachableError(f"proxy {self.url} did not answer {method} {path} (unreachable: {type(exc).__name__}: {exc})",
                                   hint=_HINT) from None

    def _ok(self, method: str, path: str, r: httpx.Response, *, whole: bool = False) -> bytes:
        """The body of a 200 answer; else RemoteError ending in ": " and the error's message (`whole`: its whole text)."""
        if r.status_code != 200:
            detail = " ".join(r.text.split())[:300] if whole else error_detail(r.content)
            raise RemoteError(f"proxy {self.url} answered {method} {path} with {r.status_code}: {detail}", status=r.status_code)
        return r.content

    def _decode(self, what: str, body: bytes, into: type[T]) -> T:
        try:
            return msgspec.json.decode(body, type=into)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteError(f"proxy {self.url} answered {what} with something that is not pdkv's proxy's: {exc}",
                              hint="pdkv's own tools need pdkv's proxy") from None

    # --- health and metrics (what a load balancer and a scraper read)
    def health(self) -> ProxyHealth:
        """Its /health, ready (`status` "ok") or not ("unavailable", with the `reason`)."""
        r = self._send("GET", HEALTH_PATH)
        if r.status_code not in (200, 503):
            self._ok("GET", HEALTH_PATH, r)
        return self._decode("GET /health", r.content, ProxyHealth)

    def metrics(self, names: Collection[str] | None = None) -> Exposition:
        """One scrape of its /metrics (only the samples of `names`, when given)."""
        return Exposition.parse(self._ok("GET", METRICS_PATH, self._send("GET", METRICS_PATH)), names)

    # --- the admin API
    def requests(self, *, limit: int = 100, errors: bool = False) -> list[ProxyTiming]:
        """The newest per-request records (only failed ones with `errors`)."""
        params = {"limit": str(limit), **({"errors": "1"} if errors else {})}
        body = self._ok("GET", REQUESTS_PATH, self._send("GET", REQUESTS_PATH, params=params))
        return self._decode(f"GET {REQUESTS_PATH}", body, list[ProxyTiming])

    def request(self, request_id: str) -> ProxyTiming | None:
        """One request's record by request or transfer id; None when it is not in the proxy's recent log."""
        path = f"{REQUESTS_PATH}/{request_id}"
        r = self._send("GET", path)
        if r.status_code == 404:
            return None
        return self._decode(f"GET {REQUESTS_PATH}", self._ok("GET", path, r), ProxyTiming)

    def planner(self) -> PlannerView:
        """The planner's last round; RemoteError (status 404) when the planner is off."""
        return self._decode(f"GET {PLANNER_PATH}", self._ok("GET", PLANNER_PATH, self._send("GET", PLANNER_PATH)), PlannerView)

    def drain(self, backend_url: str, draining: bool = True) -> DrainAnswer:
        """Route no new request to the backend at `backend_url` (or again, with `draining` False); RemoteError
        (status 404) when the proxy has no backend there."""
        r = self._send("POST", DRAIN_PATH, body=DrainRequest(backend_url, draining))
        return self._decode(f"POST {DRAIN_PATH}", self._ok("POST", DRAIN_PATH, r), DrainAnswer)

    # --- the OpenAI API
    def models(self) -> list[str]:
        """The ids of the models it serves (from a decode server's /v1/models)."""
        body = self._ok("GET", MODELS_PATH, self._send("GET", MODELS_PATH))
        ids = [m.get("id") for m in self._decode(f"GET {MODELS_PATH}", body, dict[str, Any]).get("data") or [] if isinstance(m, dict)]
        return [str(i) for i in ids if i is not None]

    def complete(self, body: dict[str, Any], *, request_id: str | None = None, timeout: float) -> bytes:
        """POST /v1/completions (not streamed); the answer's body. RemoteError's message ends in the whole answer."""
        headers = {"X-Request-Id": request_id} if request_id else None
        r = self._send("POST", COMPLETIONS_PATH, body=body, headers=headers, timeout=timeout)
        return self._ok("POST", COMPLETIONS_PATH, r, whole=True)

    def stream_completion(self, body: dict[str, Any], *, request_id: str | None = None, timeout: float) -> Iterator[dict[str, Any]]:
        """POST /v1/completions streamed: each server-sent event as it arrives (not [DONE]). An error event
        raises RemoteError; no whole answer within `timeout` raises TimeoutError_."""
        headers = {**self._headers(COMPLETIONS_PATH), "Content-Type": "application/json",
                   **({"X-Request-Id": request_id} if request_id else {})}  # fmt: skip
        try:
            with self._http.stream("POST", COMPLETIONS_PATH, content=msgspec.json.encode(body), headers=headers, timeout=timeout) as r:
                if r.status_code != 200:
                    r.read()
                    raise RemoteError(f"the request failed with {r.status_code}: {error_detail(r.content)}", status=r.status_code)
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = msgspec.json.decode(line[6:])
                    if isinstance(event, dict) and "error" in event:
                        error = event["error"]
                        said = error.get("message", error) if isinstance(error, dict) else error
                        raise RemoteError(f"the request failed mid-stream: {said}")
                    yield event
        except httpx.TimeoutException:
            raise TimeoutError_(f"no answer through {self.url} within {timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise UnreachableError(f"the request through {self.url} failed: {exc}") from None
        except msgspec.DecodeError as exc:
            raise RemoteError(f"the proxy streamed an event that is not JSON: {exc}") from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ProxyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

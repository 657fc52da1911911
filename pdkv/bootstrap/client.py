"""Clients of a bootstrap server (pdkv's or vLLM's own): sync and async, the same API.

    with BootstrapClient("http://10.0.0.2:8998") as bs:
        engines = bs.query()          # {dp_rank: EngineEntry}
    async with AsyncBootstrapClient(url, token=tok) as bs:
        await bs.register(RegisterRequest(...))

Every call has a per-request `timeout` and up to `retries` further attempts
with exponential backoff when the server cannot be reached or answers 502-504.
Then it raises UnreachableError naming the address. A 4xx answer is not
retried: 409 raises RegistryConflict, others RemoteError, with the server's message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec

from pdkv.errors import RegistryConflict, RemoteError, UnreachableError
from pdkv.wire import DeregisterRequest, DeregisterResponse, EngineEntry, LeaveRequest, MemberRecord, MembersResponse, RegisterRequest

_RETRY_STATUS = frozenset({502, 503, 504})
_BACKOFF_FIRST = 0.1
_BACKOFF_MAX = 1.0
_query_decoder = msgspec.json.Decoder(dict[str, EngineEntry])


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port` (no trailing slash)."""
    url = url.strip()
    if "://" not in url:
        url = f"http://{url}"
    return url.rstrip("/")


def backoff_delay(attempt: int) -> float:
    """Seconds to wait after failed attempt number `attempt` (0-based)."""
    return min(_BACKOFF_FIRST * 2**attempt, _BACKOFF_MAX)


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return response.text.strip()[:300] or response.reason_phrase


def _raise_for(url: str, method: str, path: str, response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    detail = _detail(response)
    message = f"bootstrap at {url} refused {method} {path} ({response.status_code}): {detail}"
    if response.status_code == 409:
        raise RegistryConflict(message, status=409, hint="stop the engine that holds the rank, or deregister it")
    hint = {
        401: "pass --token or set PDKV_TOKEN to the deployment key",
        404: "vLLM's own bootstrap server has only /register and /query; /deregister and /health need pdkv's",
    }.get(response.status_code)
    raise RemoteError(message, status=response.status_code, hint=hint)


def _unreachable(url: str, method: str, path: str, attempts: int, last: BaseException | str) -> UnreachableError:
    reason = f"{type(last).__name__}: {last}" if isinstance(last, BaseException) else last
    return UnreachableError(
        f"bootstrap at {url} did not answer {method} {path} after {attempts} attempt{'s' * (attempts != 1)} ({reason})",
        hint="check that `pdkv bootstrap` (or the prefill engine) runs there and that the host and port are right",
    )


def _parse_query(url: str, response: httpx.Response) -> dict[int, EngineEntry]:
    try:
        raw = _query_decoder.decode(response.content)
        return {int(dp): entry for dp, entry in raw.items()}
    except (msgspec.DecodeError, ValueError) as exc:
        raise RemoteError(f"bootstrap at {url} answered GET /query with something that is not a registry: {exc}") from None


def _parse_members(url: str, response: httpx.Response) -> MembersResponse:
    try:
        return msgspec.json.decode(response.content, type=MembersResponse)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteError(f"bootstrap at {url} answered GET /pdkv/members with something that is not a member list: {exc}") from None


def _body(body: Any) -> tuple[bytes | None, dict[str, str] | None]:
    """(content, headers) of a request carrying `body` as JSON, or none."""
    if body is None:
        return None, None
    return msgspec.json.encode(body), {"Content-Type": "application/json"}


def _parse_removed(response: httpx.Response) -> int:
    try:
        return msgspec.json.decode(response.content, type=DeregisterResponse).removed
    except msgspec.DecodeError:
        return 0


class _Attempts:
    """The retry rule of both clients, without I/O: the caller sleeps `delays()`, makes one attempt after
    each and hands its response (or transport error) to `settle`, until it returns the response or
    `delays()` runs out; then it raises `exhausted()`.
    """

    def __init__(self, url: str, method: str, path: str, attempts: int) -> None:
        self.url, self.method, self.path, self.attempts = url, method, path, attempts
        self.last: BaseException | str = "no attempt made"

    def delays(self) -> Iterator[float]:
        """Seconds to wait before each attempt: none before the first."""
        yield 0.0
        for attempt in range(self.attempts - 1):
            yield backoff_delay(attempt)

    def settle(self, outcome: httpx.Response | httpx.TransportError) -> httpx.Response | None:
        """The response to return; None: try again. A 4xx raises (RegistryConflict, RemoteError)."""
        if isinstance(outcome, httpx.TransportError):
            self.last = outcome
            return None
        if outcome.status_code in _RETRY_STATUS:
            self.last = f"HTTP {outcome.status_code}"
            return None
        _raise_for(self.url, self.method, self.path, outcome)
        return outcome

    def exhausted(self) -> UnreachableError:
        return _unreachable(self.url, self.method, self.path, self.attempts, self.last)


class _Base:
    def __init__(self, url: str, *, timeout: float = 2.0, retries: int = 3, token: str | None = None) -> None:
        self.url = normalize_url(url)
        self.timeout = timeout
        self.retries = max(0, retries)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    @property
    def attempts(self) -> int:
        return self.retries + 1

    @property
    def _verify(self) -> bool:
        # httpx builds a TLS context with the CA bundle for every client (about 30 ms of CPU, holding the GIL, in an
        # engine's model process): a plain http:// registry needs none.
        return self.url.startswith("https://")


class BootstrapClient(_Base):
    """Blocking client (httpx). A context manager; `close()` releases its connections."""

    def __init__(self, url: str, *, timeout: float = 2.0, retries: int = 3, token: str | None = None) -> None:
        super().__init__(url, timeout=timeout, retries=retries, token=token)
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=self._headers, trust_env=False, verify=self._verify)

    def _request(self, method: str, path: str, body: Any = None) -> httpx.Response:
        content, headers = _body(body)
        plan = _Attempts(self.url, method, path, self.attempts)
        for delay in plan.delays():
            if delay:
                time.sleep(delay)
            try:
                outcome: httpx.Response | httpx.TransportError = self._http.request(method, path, content=content, headers=headers)
            except httpx.TransportError as exc:
                outcome = exc
            if (response := plan.settle(outcome)) is not None:
                return response
        raise plan.exhausted()

    def query(self) -> dict[int, EngineEntry]:
        """Every registered prefill engine, by DP rank."""
        return _parse_query(self.url, self._request("GET", "/query"))

    def register(self, req: RegisterRequest) -> None:
        """Register one worker's side channel; an identical re-registration is fine."""
        self._request("POST", "/register", req)

    def deregister(self, engine_id: str) -> int:
        """Drop every entry of `engine_id` (pdkv's server only); returns the addresses removed."""
        return _parse_removed(self._request("POST", "/deregister", DeregisterRequest(engine_id)))

    def join(self, record: MemberRecord) -> None:
        """Add or renew this engine's member record (pdkv's server only)."""
        self._request("POST", "/pdkv/members", record)

    def leave(self, member_id: str) -> None:
        """Drop a member record now (pdkv's server only); leaving twice is fine."""
        self._request("POST", "/pdkv/members/leave", LeaveRequest(member_id))

    def members(self) -> MembersResponse:
        """The live members (pdkv's server only)."""
        return _parse_members(self.url, self._request("GET", "/pdkv/members"))

    def health(self) -> bool:
        """True if the server answers GET /health with 200 (one attempt, never raises)."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BootstrapClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncBootstrapClient(_Base):
    """asyncio client (httpx.AsyncClient): `async with AsyncBootstrapClient(url) as bs:`."""

    def __init__(self, url: str, *, timeout: float = 2.0, retries: int = 3, token: str | None = None) -> None:
        super().__init__(url, timeout=timeout, retries=retries, token=token)
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout, headers=self._headers, trust_env=False,
                                       verify=self._verify)

    async def _request(self, method: str, path: str, body: Any = None) -> httpx.Response:
        content, headers = _body(body)
        plan = _Attempts(self.url, method, path, self.attempts)
        for delay in plan.delays():
            if delay:
                await asyncio.sleep(delay)
            try:
                outcome: httpx.Response | httpx.TransportError = await self._http.request(method, path, content=content, headers=headers)
            except httpx.TransportError as exc:
                outcome = exc
            if (response := plan.settle(outcome)) is not None:
                return response
        raise plan.exhausted()

    async def query(self) -> dict[int, EngineEntry]:
        """Every registered prefill engine, by DP rank."""
        return _parse_query(self.url, await self._request("GET", "/query"))

    async def register(self, req: RegisterRequest) -> None:
        """Register one worker's side channel; an identical re-registration is fine."""
        await self._request("POST", "/register", req)

    async def deregister(self, engine_id: str) -> int:
        """Drop every entry of `engine_id` (pdkv's server only); returns the addresses removed."""
        return _parse_removed(await self._request("POST", "/deregister", DeregisterRequest(engine_id)))

    async def join(self, record: MemberRecord) -> None:
        """Add or renew this engine's member record (pdkv's server only)."""
        await self._request("POST", "/pdkv/members", record)

    async def leave(self, member_id: str) -> None:
        """Drop a member record now (pdkv's server only); leaving twice is fine."""
        await self._request("POST", "/pdkv/members/leave", LeaveRequest(member_id))

    async def members(self) -> MembersResponse:
        """The live members (pdkv's server only)."""
        return _parse_members(self.url, await self._request("GET", "/pdkv/members"))

    async def health(self) -> bool:
        """True if the server answers GET /health with 200 (one attempt, never raises)."""
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncBootstrapClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

"""Clients of a vLLM engine's own HTTP surface: GET /health, GET /metrics, POST /tokenize; sync and async.

    with EngineClient("http://127.0.0.1:8100") as engine:
        load = engine.load()                  # EngineLoad, from its /metrics
    engine = AsyncEngineClient(url, transport=the_proxys_pool)   # any EngineTransport
    ids = (await engine.tokenize(CompletionTokenize("Hello"))).tokens

Every call is one attempt bounded by `timeout`. An engine that cannot be reached, or does not answer within
it, raises UnreachableError (the proxy's own transport raises its subclass UpstreamError); an answer that is
not 200, or not what vLLM sends, raises RemoteError. `health()` and `health_problem()` never raise.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

import httpx
import msgspec

from pdkv.engine_api.readings import LOAD_NAMES, EngineLoad, EngineMetrics
from pdkv.errors import RemoteError, UnreachableError

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
TOKENIZE_PATH = "/tokenize"
_JSON = {"Content-Type": "application/json"}


class CompletionTokenize(msgspec.Struct, frozen=True):
    """POST /tokenize of a completion's prompt."""

    prompt: str
    add_special_tokens: Any = True
    model: Any = msgspec.UNSET


class ChatTokenize(msgspec.Struct, frozen=True):
    """POST /tokenize of a chat: vLLM renders it with the chat template as /v1/chat/completions would.
    Each field is the client's own, passed on as it came."""

    messages: list[Any]
    add_generation_prompt: Any = msgspec.UNSET
    continue_final_message: Any = msgspec.UNSET
    add_special_tokens: Any = msgspec.UNSET
    chat_template: Any = msgspec.UNSET
    chat_template_kwargs: Any = msgspec.UNSET
    tools: Any = msgspec.UNSET
    documents: Any = msgspec.UNSET
    model: Any = msgspec.UNSET


CHAT_FIELDS = tuple(f for f in ChatTokenize.__struct_fields__ if f != "model")


class TokenizeAnswer(msgspec.Struct, frozen=True):
    tokens: list[int]
    count: int | None = None
    max_model_len: int | None = None


class EngineTransport(Protocol):
    """How an async client reaches its engine: one request, (status, body) back, UnreachableError when none."""

    async def request(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]: ...


class HttpxTransport:
    """An EngineTransport over httpx.AsyncClient (one of its own, or a shared `http`)."""

    def __init__(self, url: str, http: httpx.AsyncClient | None = None) -> None:
        self.url = url
        self._own = http is None
        self._http = http or httpx.AsyncClient(trust_env=False)

    async def request(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        try:
            r = await self._http.request(method, self.url + path, content=body, headers=_JSON if body is not None else None,
                                         timeout=timeout)  # fmt: skip
        except httpx.HTTPError as exc:
            raise _unreachable(self.url, method, path, exc) from None
        return r.status_code, r.content

    async def close(self) -> None:
        if self._own:
            await self._http.aclose()


def _unreachable(url: str, method: str, path: str, exc: BaseException) -> UnreachableError:
    return UnreachableError(f"engine at {url} did not answer {method} {path} ({type(exc).__name__}: {exc})",
                            hint="is the engine up? (pdkv status)")


def _ok(url: str, method: str, path: str, status: int, body: bytes) -> bytes:
    if status != 200:
        detail = " ".join(body[:200].decode(errors="replace").split())
        raise RemoteError(f"engine at {url} answered {method} {path} with {status}: {detail}", status=status)
    return body


def _tokenized(url: str, body: bytes) -> TokenizeAnswer:
    try:
        return msgspec.json.decode(body, type=TokenizeAnswer)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteError(f"engine at {url} answered POST /tokenize with something that is not vLLM's: {exc}") from None


def _load(url: str, metrics: EngineMetrics) -> EngineLoad:
    load = metrics.load()
    if load is None:
        raise RemoteError(f"engine at {url} has a /metrics without vLLM's load gauges", hint="is it a vLLM engine?")
    return load


def _url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


class EngineClient:
    """Blocking client (httpx). A context manager; `close()` releases its connections."""

    def __init__(self, url: str, *, timeout: float = 2.0, http: httpx.Client | None = None) -> None:
        self.url, self.timeout = _url(url), timeout
        self._own = http is None
        self._http = http or httpx.Client(trust_env=False)

    def _request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        try:
            r = self._http.request(method, self.url + path, content=body, headers=_JSON if body is not None else None,
                                   timeout=self.timeout)  # fmt: skip
        except httpx.HTTPError as exc:
            raise _unreachable(self.url, method, path, exc) from None
        return _ok(self.url, method, path, r.status_code, r.content)

    def health_problem(self) -> str | None:
        """None when the engine answers GET /health with 2xx within the timeout, else why not (never raises)."""
        try:
            status = self._http.get(self.url + HEALTH_PATH, timeout=self.timeout).status_code
        except httpx.HTTPError as exc:
            return f"{HEALTH_PATH}: {_unreachable(self.url, 'GET', HEALTH_PATH, exc)}"
        return None if 200 <= status < 300 else f"{HEALTH_PATH} answered {status}"

    def health(self) -> bool:
        """True if the engine answers GET /health with 2xx within the timeout (never raises)."""
        return self.health_problem() is None

    def metrics(self, names: Collection[str] | None = None) -> EngineMetrics:
        """One scrape of its /metrics (only the samples of `names`, when given)."""
        return EngineMetrics.parse(self._request("GET", METRICS_PATH), names)

    def load(self) -> EngineLoad:
        """Its requests running and waiting, KV usage and prefix-cache counters now."""
        return _load(self.url, self.metrics(LOAD_NAMES))

    def tokenize(self, req: CompletionTokenize | ChatTokenize) -> TokenizeAnswer:
        return _tokenized(self.url, self._request("POST", TOKENIZE_PATH, msgspec.json.encode(req)))

    def close(self) -> None:
        if self._own:
            self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEngineClient:
    """asyncio client over an EngineTransport (default: httpx.AsyncClient). `async with` or `await close()`."""

    def __init__(self, url: str, *, timeout: float = 2.0, transport: EngineTransport | None = None,
                 http: httpx.AsyncClient | None = None) -> None:  # fmt: skip
        self.url, self.timeout = _url(url), timeout
        self._own = transport is None
        self.transport: EngineTransport = transport or HttpxTransport(self.url, http)

    async def _request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        status, answer = await self.transport.request(method, path, body, self.timeout)
        return _ok(self.url, method, path, status, answer)

    async def health_problem(self) -> str | None:
        """None when the engine answers GET /health with 2xx within the timeout, else why not (never raises)."""
        try:
            status, _ = await self.transport.request("GET", HEALTH_PATH, None, self.timeout)
        except UnreachableError as exc:
            return f"{HEALTH_PATH}: {exc}"
        return None if 200 <= status < 300 else f"{HEALTH_PATH} answered {status}"

    async def health(self) -> bool:
        """True if the engine answers GET /health with 2xx within the timeout (never raises)."""
        return await self.health_problem() is None

    async def metrics(self, names: Collection[str] | None = None) -> EngineMetrics:
        """One scrape of its /metrics (only the samples of `names`, when given)."""
        return EngineMetrics.parse(await self._request("GET", METRICS_PATH), names)

    async def load(self) -> EngineLoad:
        """Its requests running and waiting, KV usage and prefix-cache counters now."""
        return _load(self.url, await self.metrics(LOAD_NAMES))

    async def tokenize(self, req: CompletionTokenize | ChatTokenize) -> TokenizeAnswer:
        return _tokenized(self.url, await self._request("POST", TOKENIZE_PATH, msgspec.json.encode(req)))

    async def close(self) -> None:
        if self._own and isinstance(self.transport, HttpxTransport):
            await self.transport.close()

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

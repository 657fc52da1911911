"""HTTP/1.1 on asyncio protocols and httptools: the proxy's server side and its upstream pools.

The proxy forwards every request to two backends and streams one answer back,
so per-request CPU is what limits it on a small host (docs/proxy.md has the
measurements against aiohttp's and httpx's clients). Here a request costs one
C-parser pass on each side and a `transport.write` per chunk: no per-request
session, middleware or header objects.

Server side: `ServerConnection` parses requests and hands each to the app's
handler with itself as the responder (`respond`, `start_stream`, `write_chunk`,
`end_stream`); requests on one connection are answered in order.

Upstream side: `UpstreamPool` keeps idle keep-alive connections per origin.
An `Exchange` is one request on one connection; it reports head, body chunks,
completion and failure to callbacks, enforces its own deadline, and `abort()`
closes its connection so the backend sees the client go (vLLM then aborts it).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import httptools

from pdkv.errors import UpstreamError

_REASONS = {
    200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 413: b"Payload Too Large",
    500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout",
}
MAX_BODY = 64 * 2**20


class Request:
    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive")

    def __init__(self) -> None:
        self.method = ""
        self.path = ""
        self.query = ""
        self.headers: dict[str, str] = {}
        self.body = b""
        self.keep_alive = True


Handler = Callable[[Request, "ServerConnection"], Awaitable[None]]


class ServerConnection(asyncio.Protocol):
    """One client connection. `on_disconnect` (set by a handler) runs if the client goes away mid-request."""

    def __init__(self, handler: Handler, connections: set) -> None:
        self._handler = handler
        self._connections = connections
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._current = Request()
        self._url = b""
        self._body: list[bytes] = []
        self._size = 0
        self._queue: collections.deque[Request] = collections.deque()
        self._busy = False
        self.closed = False
        self.on_disconnect: Callable[[], None] | None = None
        self._keep_alive = True

    # --- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._connections.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self._connections.discard(self)
        callback, self.on_disconnect = self.on_disconnect, None
        if callback is not None:
            callback()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, b"upgrade not supported")
        except httptools.HttpParserError:
            self._fail(400, b"malformed HTTP request")

    # --- httptools callbacks
    def on_message_begin(self) -> None:
        self._current = Request()
        self._url = b""
        self._body = []
        self._size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        # curl and others wait up to a second for this before sending a large body.
        if self._current.headers.get("expect", "").lower() == "100-continue" and not self.closed:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_BODY:
            self._fail(413, b"request body too large")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        req = self._current
        req.method = self._parser.get_method().decode()
        path, _, query = self._url.decode("latin-1").partition("?")
        req.path, req.query = path, query
        req.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req.keep_alive = self._parser.should_keep_alive()
        if self._busy:
            self._queue.append(req)
        else:
            self._dispatch(req)

    def _fail(self, status: int, message: bytes) -> None:
        if not self.closed:
            self._keep_alive = False
            self.respond(status, b'{"error":{"message":"%s","type":"invalid_request_error"}}' % message)
            self.transport.close()

    def _dispatch(self, req: Request) -> None:
        self._busy = True
        self._keep_alive = req.keep_alive
        asyncio.get_running_loop().create_task(self._run(req))

    async def _run(self, req: Request) -> None:
        try:
            await self._handler(req, self)
        except Exception:  # a handler bug must not leave the client waiting
            if not self.closed:
                self.transport.close()
            raise
        finally:
            self.on_disconnect = None
        self._finished()

    def _finished(self) -> None:
        self._busy = False
        if self.closed:
            return
        if not self._keep_alive:
            self.transport.close()
        elif self._queue:
            self._dispatch(self._queue.popleft())

    # --- responder API
    def _head(self, status: int, content_type: str, extra: list[tuple[str, str]] | None, framing: bytes) -> bytes:
        lines = [b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n" % (status, _REASONS.get(status, b"Status"), content_type.encode())]
        if extra:
            lines.extend(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in extra)
        if not self._keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(framing)
        return b"".join(lines)

    def respond(
        self, status: int, body: bytes, content_type: str = "application/json", headers: list[tuple[str, str]] | None = None
    ) -> None:
        """A whole response in one write."""
        if self.closed:
            return
        self.transport.write(self._head(status, content_type, headers, b"content-length: %d\r\n\r\n" % len(body)) + body)

    def start_stream(self, status: int, content_type: str, headers: list[tuple[str, str]] | None = None, first: bytes = b"") -> None:
        """The head of a chunked response, and optionally its first chunk in the same write."""
        if self.closed:
            return
        data = self._head(status, content_type, headers, b"transfer-encoding: chunked\r\n\r\n")
        if first:
            data += b"%x\r\n%s\r\n" % (len(first), first)
        self.transport.write(data)

    def write_chunk(self, data: bytes) -> None:
        if data and not self.closed:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self, last: bytes = b"") -> None:
        if self.closed:
            return
        if last:
            self.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))
        else:
            self.transport.write(b"0\r\n\r\n")

    def abort(self) -> None:
        """Drop the connection: the client sees a truncated response."""
        self._keep_alive = False
        if not self.closed:
            self.transport.abort()


# --- upstream ------------------------------------------------------------------


class Exchange:
    """One request/response with a backend. Subclass hooks: on_head, on_body, on_complete, on_error."""

    __slots__ = ("status", "content_type", "conn", "_timer", "finished", "error", "_timeout_cause")

    def __init__(self) -> None:
        self.status = 0
        self.content_type = "application/json"
        self.conn: UpstreamConnection | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.finished = False
        self.error: UpstreamError | None = None
        self._timeout_cause = "timeout"

    def set_deadline(self, seconds: float, cause: str = "timeout") -> None:
        """Fail with `cause` unless the exchange ends (or the deadline is reset) within `seconds`."""
        if self._timer is not None:
            self._timer.cancel()
        self._timeout_cause = cause
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire, seconds)

    def clear_deadline(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, seconds: float) -> None:
        self._timer = None
        self.fail(UpstreamError(self._timeout_cause, f"no answer within {seconds:g} s"))

    def fail(self, error: UpstreamError) -> None:
        if self.finished:
            return
        self.finished = True
        self.error = error
        self.clear_deadline()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.exchange = None
            conn.transport.abort()
        self.on_error(error)

    def abort(self) -> None:
        """Cancel: close the connection so the backend sees the request go away."""
        self.fail(UpstreamError("cancelled", "cancelled by the proxy"))

    def _complete(self) -> None:
        self.finished = True
        self.clear_deadline()
        self.on_complete()

    # hooks
    def on_head(self) -> None: ...
    def on_body(self, data: bytes) -> None: ...
    def on_complete(self) -> None: ...
    def on_error(self, error: UpstreamError) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.idle_since = 0.0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.pool._open.discard(self)
        ex, self.exchange = self.exchange, None
        if ex is not None:
            ex.conn = None
            ex.fail(UpstreamError("disconnect", f"{self.pool.origin} closed the connection mid-response"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            ex = self.exchange
            self.transport.abort()
            if ex is not None:
                ex.fail(UpstreamError("disconnect", f"{self.pool.origin} sent a malformed response: {exc}"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.exchange is not None and len(name) == 12 and name.lower() == b"content-type":
            self.exchange.content_type = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        ex = self.exchange
        if ex is not None:
            ex.status = self.parser.get_status_code()
            ex.on_head()

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        if ex is not None:
            ex.on_body(body)

    def on_message_complete(self) -> None:
        ex, self.exchange = self.exchange, None
        keep = self.parser.should_keep_alive()
        if ex is not None:
            ex.conn = None
            self.pool.release(self, keep)
            ex._complete()
        else:
            self.transport.abort()


class UpstreamPool:
    """Keep-alive connections to one origin (`http://host:port`), created on demand, never capped.

    Idle connections older than `idle_timeout` are dropped rather than reused,
    so a request never lands on one the server is about to close (uvicorn closes
    after 5 s idle).
    """

    def __init__(self, origin: str, *, connect_timeout: float, idle_timeout: float = 4.0, max_idle: int = 512) -> None:
        parts = urlsplit(origin)
        self.origin = origin
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.host_header = parts.netloc.encode()
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self._idle: collections.deque[UpstreamConnection] = collections.deque()
        self._connecting: set[asyncio.Task] = set()
        self._open: set[UpstreamConnection] = set()

    def request_bytes(self, method: str, path: str, body: bytes | None, headers: list[tuple[str, str]] | None) -> bytes:
        head = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode(), path.encode(), self.host_header)]
        if headers:
            head.extend(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers)
        if body is not None:
            head.append(b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
            head.append(body)
        else:
            head.append(b"\r\n")
        return b"".join(head)

    def send(self, exchange: Exchange, data: bytes) -> None:
        """Start `exchange` now on an idle connection, or as soon as a new one connects."""
        now = time.monotonic()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn.closed or now - conn.idle_since > self.idle_timeout:
                conn.transport.close()
                continue
            self._attach(conn, exchange, data)
            return
        task = asyncio.get_running_loop().create_task(self._connect_and_send(exchange, data))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect_and_send(self, exchange: Exchange, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: UpstreamConnection(self), self.host, self.port), self.connect_timeout
            )
        except asyncio.TimeoutError:
            exchange.fail(UpstreamError("connect", f"cannot connect to {self.origin}: no answer within {self.connect_timeout:g} s"))
            return
        except OSError as exc:
            exchange.fail(UpstreamError("connect", f"cannot connect to {self.origin}: {exc.strerror or exc}"))
            return
        self._open.add(conn)
        if exchange.finished:  # cancelled while connecting
            self.release(conn, True)
            return
        self._attach(conn, exchange, data)

    def _attach(self, conn: UpstreamConnection, exchange: Exchange, data: bytes) -> None:
        conn.exchange = exchange
        exchange.conn = conn
        conn.transport.write(data)

    def release(self, conn: UpstreamConnection, keep_alive: bool) -> None:
        if keep_alive and not conn.closed and len(self._idle) < self.max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        elif not conn.closed:
            conn.transport.close()

    def fail_all(self, error: UpstreamError) -> int:
        """End every exchange in flight on this origin with `error` (the origin is gone); returns how many."""
        busy = [conn.exchange for conn in self._open if conn.exchange is not None]
        for ex in busy:
            ex.fail(error)
        return len(busy)

    def close(self) -> None:
        """Close every connection, idle or busy (a busy one's exchange fails as a disconnect)."""
        for task in list(self._connecting):
            task.cancel()
        self._idle.clear()
        for conn in list(self._open):
            if not conn.closed:
                conn.transport.abort()
        self._open.clear()


class BufferedExchange(Exchange):
    """Collects the whole answer; `future` resolves to itself when done (or fails)."""

    __slots__ = ("future", "chunks")

    def __init__(self, future: asyncio.Future) -> None:
        super().__init__()
        self.future = future
        self.chunks: list[bytes] = []

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def on_body(self, data: bytes) -> None:
        self.chunks.append(data)

    def on_complete(self) -> None:
        if not self.future.done():
            self.future.set_result(self)

    def on_error(self, error: UpstreamError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


async def fetch(pool: UpstreamPool, method: str, path: str, *, body: bytes | None = None, timeout: float) -> BufferedExchange:
    """One buffered request; raises UpstreamError on connect failure, timeout or disconnect."""
    ex = BufferedExchange(asyncio.get_running_loop().create_future())
    ex.set_deadline(timeout)
    pool.send(ex, pool.request_bytes(method, path, body, None))
    return await ex.future

"""HTTP/1.1 on asyncio protocols and httptools: the proxy's upstream pools (its listener: pdkv.proxy.listener).

The proxy forwards every request to two backends and streams one answer back,
so per-request CPU is what limits it on a small host (docs/proxy.md has the
measurements against aiohttp's and httpx's clients). Here a request costs one
C-parser pass on each side and a `transport.write` per chunk: no per-request
session, middleware or header objects.

`UpstreamPool` keeps idle keep-alive connections per origin.
An `Exchange` is one request on one connection; it reports head, body chunks,
completion and failure to callbacks, enforces its own deadline, and `abort()`
closes its connection so the backend sees the client go (vLLM then aborts it).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any
from urllib.parse import urlsplit

import httptools

from pdkv.errors import UpstreamError

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


async def connect_bounded(factory: Any, host: str, port: int, timeout: float) -> tuple[asyncio.Transport, Any]:
    """`loop.create_connection`, bounded by `timeout` (asyncio.TimeoutError), that never leaks a transport: one that
    connects after the caller timed out or was cancelled is closed (wait_for may drop it in that race)."""
    fut = asyncio.ensure_future(asyncio.get_running_loop().create_connection(factory, host, port))
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout)
    except asyncio.CancelledError:
        _discard(fut)
        raise
    if not done:
        _discard(fut)
        raise asyncio.TimeoutError
    return fut.result()  # type: ignore[return-value]


def _discard(fut: asyncio.Future) -> None:
    def close(f: asyncio.Future) -> None:
        if not f.cancelled() and f.exception() is None:
            f.result()[0].close()

    fut.cancel()
    fut.add_done_callback(close)


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
        try:
            _, conn = await connect_bounded(lambda: UpstreamConnection(self), self.host, self.port, self.connect_timeout)
        except asyncio.TimeoutError:
            exchange.fail(UpstreamError("connect", f"cannot connect to {self.origin}: no answer within {self.connect_timeout:g} s"))
            return
        except OSError as exc:
            exchange.fail(UpstreamError("connect", f"cannot connect to {self.origin}: {exc.strerror or exc}"))
            return
        if conn.closed:  # the backend closed it between accepting and this request (one that was just killed)
            exchange.fail(UpstreamError("connect", f"{self.origin} closed the connection before the request was sent"))
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


class PoolTransport:
    """pdkv.engine_api's EngineTransport over one backend's pool: the proxy's clients of an engine's /metrics and
    /tokenize ride its own upstream connections."""

    __slots__ = ("pool",)

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool

    async def request(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        ex = await fetch(self.pool, method, path, body=body, timeout=timeout)
        return ex.status, ex.body

"""The proxy's listener: HTTP/1.1 requests parsed with httptools on an asyncio protocol.

`ServerConnection` parses requests and hands each to the app's handler with
itself as the responder (`respond`, `start_stream`, `write_chunk`,
`end_stream`); requests on one connection are answered in order. Limits are
enforced while parsing, before the handler sees anything: a body over
MAX_BODY answers 413, a URL over MAX_URL 414, more than MAX_HEADERS headers or
more than MAX_HEADER_BYTES of them 431; the connection is then closed.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

import httptools

_REASONS = {
    200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 413: b"Payload Too Large",
    401: b"Unauthorized", 409: b"Conflict", 414: b"URI Too Long", 431: b"Request Header Fields Too Large",
    500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable", 504: b"Gateway Timeout",
}
MAX_BODY = 64 * 2**20  # a prompt of a million tokens is a few MB of JSON
MAX_URL = 8 * 1024
MAX_HEADERS = 100
MAX_HEADER_BYTES = 64 * 1024  # names and values together, as the client sent them
LINGER_S = 2.0  # after refusing a request, how long its remaining input is read and dropped


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
        self._header_bytes = 0
        self._queue: collections.deque[Request] = collections.deque()
        self._busy = False
        self.closed = False
        self.on_disconnect: Callable[[], None] | None = None
        self._keep_alive = True
        self._failed = False  # a limit or a parse error answered: the rest of the input is ignored

    # --- asyncio.Protocol
    @property
    def busy(self) -> bool:
        """A request on this connection is being handled (a graceful stop waits for it)."""
        return self._busy

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
        if self.closed or self._failed:
            return  # refused: the rest is dropped unread
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
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL:
            self._fail(414, b"request URL too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        # httptools may hand a long header over in pieces; each piece counts.
        self._header_bytes += len(name) + len(value)
        headers = self._current.headers
        if self._header_bytes > MAX_HEADER_BYTES or len(headers) >= MAX_HEADERS:
            self._fail(431, b"request headers too large")
            return
        headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._failed:
            return
        # curl and others wait up to a second for this before sending a large body.
        if self._current.headers.get("expect", "").lower() == "100-continue" and not self.closed:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._failed:
            return
        self._size += len(body)
        if self._size > MAX_BODY:
            self._fail(413, b"request body too large")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._failed:
            return
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
        if not self.closed and not self._failed:
            self._failed = True
            self._keep_alive = False
            self.respond(status, b'{"error":{"message":"%s","type":"invalid_request_error"}}' % message)
            # Closing with the client's bytes unread would reset the connection, and the client could lose the
            # answer: end our side, discard what still comes (data_received), and close after LINGER_S.
            if self.transport.can_write_eof():
                self.transport.write_eof()
                asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)
            else:
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

"""Stub P, D and bootstrap servers for the proxy benchmark, on raw asyncio + httptools.

They must cost little CPU: the load generator, the stubs and the proxy under
test share the machine's cores, and every proxy in a run meets the same stubs.

- P (prefill): any POST answers 200 JSON after `--p-delay-ms` (5 ms); the first
  `--capture` request bodies and headers are kept and served at GET /_stub/captured.
- D (decode): a POST with "stream": true answers an SSE stream of `--chunks` (8)
  events `--chunk-gap-ms` (1 ms) apart, then `data: [DONE]`; otherwise JSON after
  the same total time.
- bootstrap: GET /query answers one DP rank with engine id "stub-engine-0".
- every other GET (/health, /v1/models, ...) answers 200 JSON.

Run: python benchmarks/proxy/stubs.py --p-port 9100 --d-port 9200 --bootstrap-port 9300
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys

import httptools

MODELS = b'{"object":"list","data":[{"id":"stub","object":"model","owned_by":"pdkv"}]}'
QUERY = b'{"0":{"engine_id":"stub-engine-0","worker_addr":{"0":{"0":"tcp://127.0.0.1:1"}}}}'
P_BODY = (
    b'{"id":"cmpl-p","object":"text_completion","model":"stub","choices":[{"index":0,"text":"a",'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}'
)
D_EVENT = b'data: {"id":"cmpl-d","object":"text_completion","model":"stub","choices":[{"index":0,"text":"tok","finish_reason":null}]}\n\n'
D_DONE = b"data: [DONE]\n\n"
D_JSON = (
    b'{"id":"cmpl-d","object":"text_completion","model":"stub","choices":[{"index":0,"text":"tok tok tok tok tok tok tok tok",'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":8,"total_tokens":16}}'
)


def _response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 404: b"Not Found"}.get(status, b"X")
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, reason, content_type, len(body))
        + body
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class StubProtocol(asyncio.Protocol):
    """One connection to a stub; requests on it are answered in order (no pipelining needed)."""

    def __init__(self, role: str, cfg: argparse.Namespace, captured: collections.deque) -> None:
        self.role = role
        self.cfg = cfg
        self.captured = captured
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.headers: list[tuple[bytes, bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []
        self.headers = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.role == "p":
            self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        if method == b"GET":
            self._get(self.url.split(b"?", 1)[0])
        elif self.role == "p":
            self._prefill(b"".join(self.body))
        elif self.role == "d":
            asyncio.ensure_future(self._decode(b"".join(self.body)))
        else:
            self.transport.write(_response(404, b"{}"))

    def _get(self, path: bytes) -> None:
        if path == b"/query" and self.role == "bootstrap":
            body = QUERY
        elif path == b"/v1/models":
            body = MODELS
        elif path == b"/_stub/captured":
            body = json.dumps(list(self.captured)).encode()
        else:
            body = b"{}"
        self.transport.write(_response(200, body))

    def _prefill(self, body: bytes) -> None:
        if len(self.captured) < (self.captured.maxlen or 0):
            self.captured.append(
                {"body": json.loads(body), "headers": {k.decode().lower(): v.decode() for k, v in self.headers}}
            )
        loop = asyncio.get_running_loop()
        loop.call_later(self.cfg.p_delay_ms / 1000, self._write_if_open, _response(200, P_BODY))

    def _write_if_open(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    async def _decode(self, body: bytes) -> None:
        gap = self.cfg.chunk_gap_ms / 1000
        if b'"stream":true' not in body.replace(b" ", b""):
            await asyncio.sleep(gap * (self.cfg.chunks - 1))
            self._write_if_open(_response(200, D_JSON))
            return
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        self._write_if_open(head + _chunk(D_EVENT))
        for i in range(1, self.cfg.chunks):
            await asyncio.sleep(gap)
            if self.transport.is_closing():
                return
            last = i == self.cfg.chunks - 1
            self.transport.write(_chunk(D_EVENT + D_DONE) + b"0\r\n\r\n" if last else _chunk(D_EVENT))


async def serve(cfg: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    captured: collections.deque = collections.deque(maxlen=cfg.capture)
    servers = []
    for role, port in (("p", cfg.p_port), ("d", cfg.d_port), ("bootstrap", cfg.bootstrap_port)):
        servers.append(
            await loop.create_server(lambda r=role: StubProtocol(r, cfg, captured), "127.0.0.1", port, backlog=1024)
        )
    print("stubs ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p-port", type=int, required=True)
    ap.add_argument("--d-port", type=int, required=True)
    ap.add_argument("--bootstrap-port", type=int, required=True)
    ap.add_argument("--p-delay-ms", type=float, default=5.0)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-gap-ms", type=float, default=1.0)
    ap.add_argument("--capture", type=int, default=4, help="first P requests to keep for GET /_stub/captured")
    cfg = ap.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()

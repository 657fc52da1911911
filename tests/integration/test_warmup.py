"""Warm-up requests against a real HTTP server on 127.0.0.1 standing in for the proxy: sent, bounded, one-line errors."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdkv.deploy.run.warmup import warm_up
from pdkv.errors import StartError


class FakeProxy(BaseHTTPRequestHandler):
    status = 200
    delay_s = 0.0
    seen: list[tuple[dict, str]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((body, self.headers.get("X-Request-Id", "")))
        time.sleep(self.delay_s)
        payload = b'{"choices": [{"text": "x"}]}' if self.status == 200 else b'{"error": {"message":\n  "no decode server is ready"}}'
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the bounded test hangs up before the answer: a broken pipe here is expected


@pytest.fixture
def proxy() -> Iterator[str]:
    FakeProxy.status, FakeProxy.delay_s, FakeProxy.seen = 200, 0.0, []
    server = QuietServer(("127.0.0.1", 0), FakeProxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_warm_up_sends_one_token_requests_one_after_another(proxy: str) -> None:
    took = warm_up(proxy, "tiny", requests=2, timeout=5)
    assert len(took) == 2 and all(ms > 0 for ms in took)
    bodies = [b for b, _ in FakeProxy.seen]
    assert [b["max_tokens"] for b in bodies] == [1, 1] and {b["model"] for b in bodies} == {"tiny"}
    ids = [rid for _, rid in FakeProxy.seen]
    assert all(rid.startswith("pdkv-warmup-") for rid in ids) and len(set(ids)) == 2


def test_a_refused_warm_up_is_one_line(proxy: str) -> None:
    FakeProxy.status = 503
    with pytest.raises(StartError) as info:
        warm_up(proxy, "tiny", timeout=5)
    assert info.value.message == f'warm-up request 1 through {proxy} answered 503: {{"error": {{"message": "no decode server is ready"}}}}'
    assert "\n" not in info.value.message


def test_a_warm_up_without_an_answer_is_bounded(proxy: str) -> None:
    FakeProxy.delay_s = 3.0
    t0 = time.monotonic()
    with pytest.raises(StartError, match="had no answer within 0.5 s"):
        warm_up(proxy, "tiny", timeout=0.5)
    assert time.monotonic() - t0 < 2.5


def test_an_unreachable_proxy_is_a_start_error() -> None:
    with pytest.raises(StartError, match="failed"):
        warm_up("http://127.0.0.1:1", "tiny", timeout=2)

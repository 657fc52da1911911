"""The proxy against stub P and D servers (real aiohttp servers on 127.0.0.1) and a real
pdkv bootstrap server: rewriting, readiness, engine-id refresh, health, and every
failure coupling. Each test finishes in a few seconds; every wait is bounded."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pdkv.auth import binding_matches
from pdkv.bootstrap import BootstrapClient
from pdkv.wire import RegisterRequest
from pdkv.proxy.config import build_config
from pdkv.proxy.server import BackgroundProxy
from support.proxy_stubs import REQUEST, Deployment
from support.waiting import wait_for

@pytest.fixture
def deployment() -> Iterator[Deployment]:
    with Deployment() as dep:
        yield dep




def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_stream_is_forwarded_and_both_copies_rewritten(deployment: Deployment):
    with deployment.client() as c:
        r = c.post("/v1/completions", json=REQUEST, headers={"X-Request-Id": "req-42"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "req-42"
    assert _events(r.text) == [json.dumps({"choices": [{"index": 0, "text": "tok"}]}, separators=(",", ":"))] * 3 + ["[DONE]"]
    # A stream ends with D's answer: P's copy may still be on its way to the stub.
    wait_for(lambda: len(deployment.prefills[0].seen) == 1, what="P's copy")
    (p_headers, p_body), = deployment.prefills[0].seen
    (d_headers, d_body), = deployment.decodes[0].seen
    assert p_body["max_tokens"] == 1 and p_body["min_tokens"] == 1 and p_body["stream"] is False
    assert "stop" not in p_body and "stop_token_ids" not in p_body
    tid = p_body["kv_transfer_params"]["transfer_id"]
    # Minted by the proxy (128 random bits), not taken from the client's X-Request-Id.
    assert re.fullmatch(r"xfer-[0-9a-f]{32}", tid) and "req-42" not in tid
    commitment = p_body["kv_transfer_params"].pop("decode_binding")
    assert p_body["kv_transfer_params"] == {"transfer_id": tid, "do_remote_decode": True, "do_remote_prefill": False}
    assert p_headers["x-request-id"] == "req-42" and "x-data-parallel-rank" not in p_headers
    assert d_body["max_tokens"] == 16 and d_body["stream"] is True and d_body["stop"] == ["\n\n"]
    # Only D gets the binding secret; P gets its SHA-256.
    assert binding_matches(d_body["kv_transfer_params"].pop("binding"), commitment)
    assert d_body["kv_transfer_params"] == {
        "transfer_id": tid,
        "remote_bootstrap_addr": deployment.bootstraps[0].url,
        "remote_engine_id": "engine-a",
        "do_remote_decode": False,
        "do_remote_prefill": True,
    }
    assert d_headers["x-request-id"] == "req-42"


def test_timings_are_recorded_per_request(deployment: Deployment):
    with deployment.client() as c:
        assert c.post("/v1/completions", json=REQUEST, headers={"X-Request-Id": "t-1"}).status_code == 200
        # The client's stream ends with D's; the record has P's status once P answered too.
        wait_for(lambda: "prefill_status" in c.get("/pdkv/requests/t-1").json(), what="P's answer in the record")
        t = c.get("/pdkv/requests/t-1").json()
        assert c.get(f"/pdkv/requests/{t['transfer_id']}").json() == t
        recent = c.get("/pdkv/requests", params={"limit": 5}).json()
        assert c.get("/pdkv/requests/nope").status_code == 404
    assert recent[0]["request_id"] == "t-1"
    assert t["status"] == 200 and t["prefill_status"] == 200 and t["stream"] is True and "error" not in t
    assert t["received"] <= t["prefill_dispatched"] <= t["decode_dispatched"] <= t["decode_first_byte"] <= t["last_byte"]
    assert t["prefill_dispatched"] <= t["prefill_responded"]


def test_non_stream_and_chat_and_models(deployment: Deployment):
    with deployment.client() as c:
        r = c.post("/v1/completions", json={**REQUEST, "stream": False})
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9})
        models = c.get("/v1/models")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "d0 answer"
    assert chat.status_code == 200 and chat.json()["choices"][0]["text"] == "d0 answer"
    p_chat = deployment.prefills[0].seen[-1][1]
    assert p_chat["max_completion_tokens"] == 1 and p_chat["max_tokens"] == 1
    assert deployment.decodes[0].seen[-1][1]["max_completion_tokens"] == 9
    assert models.json()["data"][0]["id"] == "model-from-d0"


def test_not_ready_until_an_engine_registers_then_ready():
    with Deployment(engines={}, local_fallback=False) as dep, dep.client() as c:
        r = c.get("/health")
        assert r.status_code == 503 and "no engine registered" in r.json()["reason"]
        refused = c.post("/v1/completions", json=REQUEST)
        assert refused.status_code == 503 and refused.json()["error"]["cause"] == "no_backend"
        dep.register(0, "engine-late")
        wait_for(lambda: c.get("/health").status_code == 200, what="readiness")
        assert c.post("/v1/completions", json=REQUEST).status_code == 200
        assert dep.decodes[0].seen[-1][1]["kv_transfer_params"]["remote_engine_id"] == "engine-late"


def test_engine_id_is_reread_when_prefill_restarts(deployment: Deployment):
    with deployment.client() as c:
        deployment.deregister(0, "engine-a")
        deployment.register(0, "engine-b")
        wait_for(lambda: c.get("/health").json()["backends"][0]["engines"] == {"0": "engine-b"}, what="new engine id")
        assert c.post("/v1/completions", json=REQUEST).status_code == 200
    assert deployment.decodes[0].seen[-1][1]["kv_transfer_params"]["remote_engine_id"] == "engine-b"


def test_failed_bootstrap_query_drops_the_engine_id(deployment: Deployment):
    with deployment.client() as c:
        deployment.bootstraps[0].stop()
        wait_for(lambda: c.get("/health").status_code == 503, what="prefill taken out")
        body = c.get("/health").json()
        assert body["backends"][0]["engines"] == {} and "bootstrap" in body["reason"]


def test_dp_ranks_each_get_their_engine_id():
    with Deployment(engines={0: "engine-r0", 1: "engine-r1"}) as dep, dep.client() as c:
        for _ in range(4):
            assert c.post("/v1/completions", json=REQUEST).status_code == 200
        wait_for(lambda: len(dep.prefills[0].seen) == 4, what="P's copies")
    pairs = [(h["x-data-parallel-rank"], d[1]["kv_transfer_params"]["remote_engine_id"])
             for (h, _), d in zip(dep.prefills[0].seen, dep.decodes[0].seen)]
    assert sorted(pairs) == [("0", "engine-r0"), ("0", "engine-r0"), ("1", "engine-r1"), ("1", "engine-r1")]


@pytest.mark.parametrize(("p_status", "client_status", "fallback"), [(500, 502, False), (400, 400, True), (400, 400, False)])
def test_prefill_error_cancels_decode_at_once(p_status: int, client_status: int, fallback: bool):
    # Without local fallback any P error reaches the client; a 4xx (the request itself is bad) always does.
    with Deployment(local_fallback=fallback) as deployment, deployment.client() as c:
        deployment.prefills[0].behaviour.update(status=p_status)
        deployment.decodes[0].behaviour.update(hang=True)  # D waits for KV that will never come
        t0 = time.monotonic()
        r = c.post("/v1/completions", json=REQUEST)
        elapsed = time.monotonic() - t0
        assert r.status_code == client_status
        err = r.json()["error"]
        assert err["cause"] == "prefill_status" and "p0 says no" in err["message"]
        assert elapsed < 2.0
        wait_for(lambda: deployment.decodes[0].cancelled == 1, what="D cancelled")


def test_prefill_timeout_cancels_both():
    with Deployment(prefill_timeout=0.5, local_fallback=False) as dep, dep.client() as c:
        dep.prefills[0].behaviour.update(hang=True)
        dep.decodes[0].behaviour.update(hang=True)
        t0 = time.monotonic()
        r = c.post("/v1/completions", json={**REQUEST, "stream": False})
        elapsed = time.monotonic() - t0
        assert r.status_code == 504 and r.json()["error"]["cause"] == "prefill_timeout"
        assert 0.4 < elapsed < 2.5
        wait_for(lambda: dep.decodes[0].cancelled == 1 and dep.prefills[0].cancelled == 1, what="both cancelled")
        assert 'pdkv_proxy_errors_total{cause="prefill_timeout"} 1.0\n' in c.get("/metrics").text


@pytest.mark.parametrize("fallback", [True, False])
def test_prefill_failing_after_decodes_first_byte_does_not_touch_the_stream(fallback: bool):
    # D's first byte means its KV arrived: P's own answer no longer matters.
    with Deployment(local_fallback=fallback) as deployment, deployment.client() as c:
        deployment.prefills[0].behaviour.update(status=500, delay=0.2)
        deployment.decodes[0].behaviour.update(chunks=4, gap=0.15)
        r = c.post("/v1/completions", json=REQUEST)
        assert r.status_code == 200
        events = _events(r.text)
        assert events == ['{"choices":[{"index":0,"text":"tok"}]}'] * 4 + ["[DONE]"]
        assert deployment.decodes[0].cancelled == 0 and len(deployment.decodes[0].seen) == 1


def test_decode_error_reaches_the_client_and_cancels_prefill(deployment: Deployment):
    deployment.prefills[0].behaviour.update(hang=True)
    deployment.decodes[0].behaviour.update(status=400, body={"error": {"message": "prompt too long for D"}})
    with deployment.client() as c:
        r = c.post("/v1/completions", json=REQUEST)
        assert r.status_code == 400 and r.json() == {"error": {"message": "prompt too long for D"}}
        wait_for(lambda: deployment.prefills[0].cancelled == 1, what="P cancelled")
        assert c.get("/pdkv/requests").json()[0]["error"] == "decode_status"


class FateServer:
    """A P worker's side channel that answers stats queries with one failed transfer, as pdkv's connector would."""

    def __init__(self, transfer_id: Callable[[], str]) -> None:
        from pdkv.connector.side_channel import EventLoopThread, SideChannelServer

        self.transfer_id = transfer_id  # asked when a query comes: the proxy mints transfer ids
        self.seen: list[Any] = []
        self.loop = EventLoopThread("fate")
        self.server = SideChannelServer(self.loop, "127.0.0.1", self.handle)

    async def handle(self, identity: bytes, msg: Any) -> None:
        from pdkv.wire import StatsQuery, StatsReply, TransferTrace

        self.seen.append(msg)
        if isinstance(msg, StatsQuery):
            trace = TransferTrace(transfer_id=self.transfer_id(), status="cancelled",
                                  error="prefill request p-1 finished as FINISHED_ABORTED", events={"registered": time.time()})
            await self.server.send(identity, StatsReply(engine_id="engine-a", tp_rank=0, traces=[trace], metrics=""))

    def close(self) -> None:
        self.server.close()
        self.loop.stop()


def _transfer_id(dep: Deployment) -> str:
    """The transfer id of the last request D saw (the proxy mints them; P's copy, sent beside D's, may still be on its way)."""
    return str(dep.decodes[0].seen[-1][1]["kv_transfer_params"]["transfer_id"])


def _register_side_channel(dep: Deployment, addr: str) -> None:
    dep.deregister(0, "engine-a")
    with BootstrapClient(dep.bootstraps[0].url, retries=0) as bs:
        bs.register(RegisterRequest(engine_id="engine-a", dp_rank=0, tp_rank=0, pp_rank=0, addr=addr))
    wait_for(lambda: addr in json.dumps(httpx.get(f"{dep.bootstraps[0].url}/query").json()), what="registration")
    time.sleep(0.3)  # a health round picks up the worker's address


@pytest.mark.parametrize("stream", [False, True])
def test_decode_failure_says_why_the_kv_did_not_come(deployment: Deployment, stream: bool):
    # D (vLLM) only says "Internal server error"; P's connector knows the transfer was cancelled, and why.
    fate = FateServer(lambda: _transfer_id(deployment))
    try:
        _register_side_channel(deployment, fate.server.address)
        if stream:
            deployment.decodes[0].behaviour.update(error_event=True)
        else:
            deployment.decodes[0].behaviour.update(status=500, body={"error": {"message": "Internal server error"}})
        with deployment.client() as c:
            r = c.post("/v1/completions", json={**REQUEST, "stream": stream}, headers={"X-Request-Id": "req-fate"})
            err = json.loads(_events(r.text)[0])["error"] if stream else r.json()["error"]
            assert err["cause"] == "decode_kv_transfer"
            assert "Internal server error" in err["message"]
            assert f"{_transfer_id(deployment)} cancelled: prefill request p-1 finished as FINISHED_ABORTED" in err["message"]
            _assert_no_address(r.text)
            assert deployment.decodes[0].url in c.get("/pdkv/requests/req-fate").json()["detail"]
            assert c.get("/pdkv/requests").json()[0]["error"] == "decode_kv_transfer"
    finally:
        fate.close()


def test_decode_failure_without_a_pdkv_side_channel_is_passed_through_in_bounded_time(deployment: Deployment):
    # The stub P's side channel is not pdkv's (as with vLLM's connector): D's own answer goes to the client.
    deployment.decodes[0].behaviour.update(status=500, body={"error": {"message": "Internal server error"}})
    with deployment.client() as c:
        start = time.monotonic()
        r = c.post("/v1/completions", json=REQUEST)
        assert r.status_code == 500 and r.json() == {"error": {"message": "Internal server error"}}
        assert time.monotonic() - start < 2.0


def test_decode_first_byte_timeout():
    with Deployment(decode_first_byte_timeout=0.5) as dep, dep.client() as c:
        dep.decodes[0].behaviour.update(hang=True)
        r = c.post("/v1/completions", json=REQUEST)
        assert r.status_code == 504 and r.json()["error"]["cause"] == "decode_timeout"
        wait_for(lambda: dep.decodes[0].cancelled == 1, what="D cancelled")


def test_client_disconnect_cancels_both_upstream_requests(deployment: Deployment):
    deployment.prefills[0].behaviour.update(hang=True)
    deployment.decodes[0].behaviour.update(hang=True)
    body = json.dumps(REQUEST).encode()
    port = deployment.proxy.port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: gone-1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: len(deployment.decodes[0].seen) == 1 and len(deployment.prefills[0].seen) == 1, what="dispatch")
    wait_for(lambda: deployment.prefills[0].cancelled == 1 and deployment.decodes[0].cancelled == 1, what="both cancelled")
    with deployment.client() as c:
        wait_for(lambda: c.get("/pdkv/requests/gone-1").json().get("error") == "client_disconnect", what="record")


def test_unhealthy_decode_is_taken_out_and_put_back():
    with Deployment(n_decode=2) as dep, dep.client() as c:
        dep.decodes[1].behaviour.update(healthy=False)
        wait_for(lambda: not c.get("/health").json()["backends"][2]["up"], what="d1 out")
        for _ in range(4):
            assert c.post("/v1/completions", json=REQUEST).status_code == 200
        assert len(dep.decodes[1].seen) == 0 and len(dep.decodes[0].seen) == 4
        dep.decodes[1].behaviour.update(healthy=True)
        wait_for(lambda: c.get("/health").json()["backends"][2]["up"], what="d1 back")
        for _ in range(4):
            assert c.post("/v1/completions", json=REQUEST).status_code == 200
        assert len(dep.decodes[1].seen) == 2 and len(dep.decodes[0].seen) == 6
        assert 'pdkv_proxy_backend_up{role="decode",url="%s"} 1' % dep.decodes[1].url in c.get("/metrics").text


def test_unreachable_decode_is_taken_out_on_connect_failure():
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens there now
    with Deployment(health_interval=30.0) as dep:
        dep.proxy.stop()
        cfg = build_config([f"{dep.prefills[0].url},{dep.bootstraps[0].url}"], [dep.decodes[0].url, dead_url],
                           port=0, health_interval=30.0, unhealthy_after=5)
        with BackgroundProxy(cfg) as proxy, httpx.Client(base_url=proxy.url, timeout=10, trust_env=False) as c:
            # The first health round already found it down; force it up to test the request path.
            proxy.call(lambda: _force_up(proxy))
            statuses = [c.post("/v1/completions", json=REQUEST).status_code for _ in range(4)]
            assert statuses.count(502) == 1 and statuses.count(200) == 3
            assert not c.get("/health").json()["backends"][2]["up"]


def _force_up(proxy: BackgroundProxy) -> None:
    for d in proxy.app.backends.decodes:
        d.up = True
    proxy.app.backends.rebuild()


def test_least_outstanding_avoids_a_busy_decode():
    with Deployment(n_decode=2, policy="least-outstanding") as dep:
        for d in dep.decodes:  # whichever gets the first request holds it for 1 s
            d.behaviour.update(delay=1.0)
        results: list[int] = []

        def slow() -> None:
            with dep.client() as c:
                results.append(c.post("/v1/completions", json=REQUEST).status_code)

        thread = threading.Thread(target=slow)
        thread.start()
        wait_for(lambda: len(dep.decodes[0].seen) + len(dep.decodes[1].seen) == 1, what="first request")
        for d in dep.decodes:
            d.behaviour.update(delay=0.0)
        with dep.client() as c:
            for _ in range(3):
                assert c.post("/v1/completions", json=REQUEST).status_code == 200
        thread.join(5)
        busy = 0 if dep.decodes[0].seen else 1
        assert len(dep.decodes[busy].seen) == 1 and len(dep.decodes[1 - busy].seen) == 3 and results == [200]


def test_expect_100_continue_is_answered_before_the_body(deployment: Deployment):
    body = json.dumps({**REQUEST, "stream": False}).encode()
    with socket.create_connection(("127.0.0.1", deployment.proxy.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        answer = b""
        while b"d0 answer" not in answer:
            chunk = s.recv(4096)
            assert chunk, "connection closed before the answer"
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 OK")


def test_shutdown_closes_upstream_requests_still_in_flight(deployment: Deployment):
    deployment.prefills[0].behaviour.update(delay=3.0)  # D finishes first; P is still busy
    with deployment.client() as c:
        t0 = time.monotonic()
        assert c.post("/v1/completions", json=REQUEST).status_code == 200
        assert time.monotonic() - t0 < 2.0
    deployment.proxy.stop()
    wait_for(lambda: deployment.prefills[0].cancelled == 1, what="P's connection closed at shutdown")


# --- what the client is told, and what only the log and the record hold --------------------------


def _assert_no_address(text: str) -> None:
    for needle in ("127.0.0.1", "http://", "tcp://"):
        assert needle not in text, text


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


@contextlib.contextmanager
def _proxy_with(dep: Deployment, prefill_url: str, decode_url: str) -> Iterator[BackgroundProxy]:
    """A proxy in front of these URLs with every backend forced up and P's engine known (no health round interferes)."""
    dep.proxy.stop()
    cfg = build_config([f"{prefill_url},{dep.bootstraps[0].url}"], [decode_url], port=0, health_interval=30.0, unhealthy_after=5,
                       local_fallback=False)
    with BackgroundProxy(cfg) as proxy:
        wait_for(lambda: proxy.app.health.rounds >= 1, what="first health round")

        def force_up() -> None:
            for b in (*proxy.app.backends.prefills, *proxy.app.backends.decodes):
                b.up = True
            proxy.app.backends.prefills[0].engines = {0: "engine-a"}
            proxy.app.backends.rebuild()

        proxy.call(force_up)
        yield proxy


ADDRESSY = {"error": {"message": "prompt too long (max 8 tokens); see http://127.0.0.1:9/limits on 10.0.0.7:8100"}}


@pytest.mark.parametrize("case", ["prefill-connect", "prefill-4xx", "decode-connect", "decode-5xx"])
def test_client_facing_errors_carry_no_backend_address(case: str):
    with Deployment(health_interval=30.0) as dep:
        dead = _dead_url()
        p_url, d_url = dep.prefills[0].url, dep.decodes[0].url
        if case == "prefill-connect":
            p_url = dead
            dep.decodes[0].behaviour.update(hang=True)
        elif case == "decode-connect":
            d_url = dead
            dep.prefills[0].behaviour.update(hang=True)
        elif case == "prefill-4xx":
            dep.prefills[0].behaviour.update(status=400, body=ADDRESSY)
            dep.decodes[0].behaviour.update(hang=True)
        else:
            dep.prefills[0].behaviour.update(hang=True)
            dep.decodes[0].behaviour.update(status=500, body={"error": {"message": "engine at http://127.0.0.1:8200 died"}})
        with _proxy_with(dep, p_url, d_url) as proxy, httpx.Client(base_url=proxy.url, timeout=10, trust_env=False) as c:
            r = c.post("/v1/completions", json={**REQUEST, "stream": False}, headers={"X-Request-Id": f"addr-{case}"})
            record = c.get(f"/pdkv/requests/addr-{case}").json()
    _assert_no_address(r.text)
    err = r.json()["error"]
    status, cause, message = {
        "prefill-connect": (502, "prefill_connect", "prefill failed: could not connect to the prefill server"),
        "prefill-4xx": (
            400, "prefill_status", "prefill refused the request (400): prompt too long (max 8 tokens); see <address> on <address>"
        ),
        "decode-connect": (502, "decode_connect", "decode failed: could not connect to the decode server"),
        "decode-5xx": (500, "decode_status", "engine at <address> died"),  # D's own body, minus the address
    }[case]
    assert r.status_code == status and err["message"] == message
    if case != "decode-5xx":
        assert err["cause"] == cause and err["request_id"] == f"addr-{case}" and err["type"] == "pdkv_proxy_error"
    # The whole story, with the address, is kept for the operator.
    backend = dead if case.endswith("connect") else (p_url if case.startswith("prefill") else d_url)
    assert record["error"] == cause and backend in record["detail"]


def test_bad_fields_the_proxy_reads_are_400_before_any_backend_is_asked(deployment: Deployment):
    with deployment.client() as c:
        for bad in ({"stream": "yes"}, {"stream": 1}, {"n": 0}, {"n": True}, {"n": 2**70}):
            r = c.post("/v1/completions", json={**REQUEST, **bad})
            assert r.status_code == 400, (bad, r.text)
            err = r.json()["error"]
            field = next(iter(bad))
            assert err["cause"] == "bad_request" and f"$.{field}" in err["message"] and "\n" not in err["message"]
        # null is "not given", as vLLM reads it
        assert c.post("/v1/completions", json={**REQUEST, "stream": None, "n": None}).status_code == 200
    assert len(deployment.prefills[0].seen) == len(deployment.decodes[0].seen) == 1


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("failure", ["status-500", "connect"])
def test_prefill_failing_before_decodes_first_byte_is_served_by_decode_alone(stream: bool, failure: str):
    with Deployment() as dep:
        p_url = dep.prefills[0].url
        if failure == "connect":
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                p_url = f"http://127.0.0.1:{s.getsockname()[1]}"
        else:
            dep.prefills[0].behaviour.update(status=500, delay=0.1)
        dep.decodes[0].behaviour.update(hang_pd=True)  # the P/D copy waits for KV that will never come
        dep.proxy.stop()
        cfg = build_config([f"{p_url},{dep.bootstraps[0].url}"], [dep.decodes[0].url], port=0, health_interval=30.0)
        with BackgroundProxy(cfg) as proxy, httpx.Client(base_url=proxy.url, timeout=10, trust_env=False) as c:
            proxy.app.backends.prefills[0].up = True
            proxy.app.backends.prefills[0].engines = {0: "engine-a"}
            proxy.app.backends.decodes[0].up = True
            proxy.app.backends.rebuild()
            r = c.post("/v1/completions", json={**REQUEST, "stream": stream}, headers={"X-Request-Id": f"fb-{failure}-{stream}"})
            record = c.get(f"/pdkv/requests/fb-{failure}-{stream}").json()
            metrics = c.get("/metrics").text
        assert r.status_code == 200, r.text
        assert "error" not in r.text
        local = dep.decodes[0].seen[-1][1]
        assert "kv_transfer_params" not in local and local["max_tokens"] == REQUEST["max_tokens"]
        cause = "prefill_connect" if failure == "connect" else "prefill_status"
        assert record["local_prefill"] == f"prefill_failed: {cause}" and record["status"] == 200 and "error" not in record
        assert 'pdkv_proxy_local_prefill_total{reason="prefill_failed"} 1.0\n' in metrics
        wait_for(lambda: dep.decodes[0].cancelled >= 1, what="the P/D copy on D cancelled")


def test_no_prefill_up_serves_from_decode_alone_until_one_registers():
    with Deployment(engines={}) as dep, dep.client() as c:
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={**REQUEST, "stream": False}, headers={"X-Request-Id": "alone-1"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "d0 answer"
        assert "kv_transfer_params" not in dep.decodes[0].seen[-1][1] and not dep.prefills[0].seen
        assert c.get("/pdkv/requests/alone-1").json()["local_prefill"] == "no_prefill"
        assert 'pdkv_proxy_local_prefill_total{reason="no_prefill"} 1.0\n' in c.get("/metrics").text
        dep.register(0, "engine-late")
        wait_for(lambda: c.get("/health").status_code == 200, what="readiness")
        assert c.post("/v1/completions", json=REQUEST).status_code == 200
        assert dep.decodes[0].seen[-1][1]["kv_transfer_params"]["remote_engine_id"] == "engine-late"


@pytest.mark.parametrize("n", [1, 3])
def test_a_decode_that_never_answered_releases_the_transfer_at_prefill(deployment: Deployment, n: int):
    # No D request will pull this KV: P's connector is told at once (one Release per choice), not after its expiry.
    from pdkv.wire import Release

    fate = FateServer(lambda: "unused")
    try:
        _register_side_channel(deployment, fate.server.address)
        deployment.decodes[0].behaviour.update(status=400, body={"error": {"message": "bad"}})
        with deployment.client() as c:
            r = c.post("/v1/completions", json={**REQUEST, "stream": False, "n": n, "temperature": 1.0},
                       headers={"X-Request-Id": f"rel-{n}"})
        assert r.status_code == 400
        wait_for(lambda: sum(isinstance(m, Release) for m in fate.seen) == n, what="the Releases at P")
        assert all(m.transfer_id == _transfer_id(deployment) for m in fate.seen if isinstance(m, Release))
        # The proxy's release proves the binding, as D's would.
        p_seen = deployment.prefills[0].seen
        wait_for(lambda: p_seen and p_seen[-1][1]["kv_transfer_params"]["transfer_id"] == _transfer_id(deployment), what="P's copy")
        commitment = deployment.prefills[0].seen[-1][1]["kv_transfer_params"]["decode_binding"]
        assert all(binding_matches(m.binding, commitment) for m in fate.seen if isinstance(m, Release))
        deployment.decodes[0].behaviour.update(status=200)
        with deployment.client() as c:
            assert c.post("/v1/completions", json={**REQUEST, "stream": False}).status_code == 200
        time.sleep(0.3)
        assert sum(isinstance(m, Release) for m in fate.seen) == n  # a served request releases nothing
    finally:
        fate.close()

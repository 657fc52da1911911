"""The bootstrap server and its clients, for real, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from aiohttp import web

from pdkv.bootstrap import AsyncBootstrapClient, BootstrapClient, ProbePolicy, start_background
from pdkv.errors import RegistryConflict, RemoteError, UnreachableError
from pdkv.wire import EngineEntry, RegisterRequest
from pdkv.service import BackgroundService
from support.waiting import wait_until

NO_SWEEP = ProbePolicy(timeout=0.3, interval=0)


@contextlib.contextmanager
def live_addr():
    """A listening TCP socket (a stand-in for a live side channel), as tcp://127.0.0.1:port."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def dead_addr() -> str:
    """An address nothing listens on: bound, then released."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def body(engine="eng-a", dp=0, tp=0, pp=0, addr="tcp://127.0.0.1:5000") -> dict:
    return {"engine_id": engine, "dp_rank": dp, "tp_rank": tp, "pp_rank": pp, "addr": addr}


@pytest.fixture
def server():
    with start_background(probe=NO_SWEEP) as svc:
        yield svc


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=5, trust_env=False) as client:
        yield client


def metric(http: httpx.Client, line_prefix: str) -> int:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(line_prefix + " "):
            return int(float(line.rsplit(" ", 1)[1]))  # prometheus_client writes counts as floats
    raise AssertionError(f"{line_prefix} not in /metrics")


# --- vLLM compatibility -----------------------------------------------------


def test_register_and_query_in_vllms_shape(http):
    with live_addr() as a0, live_addr() as a1:
        # What vLLM's worker posts: pydantic model_dump() of its payload, as JSON.
        assert http.post("/register", json=body(tp=0, addr=a0)).status_code == 200
        r = http.post("/register", json=body(tp=1, addr=a1))
        assert r.status_code == 200 and r.json()["status"] == "ok"
        data = http.get("/query").json()
    assert data == {"0": {"engine_id": "eng-a", "worker_addr": {"0": {"0": a0}, "1": {"0": a1}}}}
    # D's worker: engine_id -> {int tp: {int pp: addr}}, tp size = len(worker_addr).
    agents = {e["engine_id"]: {int(tp): {int(pp): a for pp, a in t.items()} for tp, t in e["worker_addr"].items()} for e in data.values()}
    assert agents == {"eng-a": {0: {0: a0}, 1: {0: a1}}}
    # vLLM's example proxy: dp rank -> engine_id, dp size = len(data).
    assert {int(dp): e["engine_id"] for dp, e in data.items()} == {0: "eng-a"} and len(data) == 1


def test_identical_reregistration_is_ok(http):
    with live_addr() as a:
        assert http.post("/register", json=body(addr=a)).json()["result"] == "created"
        assert http.post("/register", json=body(addr=a)).json()["result"] == "unchanged"
        assert http.get("/query").json()["0"]["worker_addr"] == {"0": {"0": a}}
    assert metric(http, 'pdkv_bootstrap_registrations_total{result="unchanged"}') == 1


def test_other_engine_for_a_live_dp_rank_is_409_naming_both(http):
    with live_addr() as a, live_addr() as b:
        http.post("/register", json=body(engine="eng-a", addr=a))
        before = http.get("/query").json()
        r = http.post("/register", json=body(engine="eng-b", addr=b))
        assert r.status_code == 409
        detail = r.json()["detail"]
        assert "'eng-a'" in detail and "'eng-b'" in detail and a in detail and b in detail
        assert http.get("/query").json() == before
    assert metric(http, 'pdkv_bootstrap_rejects_total{reason="conflict"}') == 1


def test_other_addr_for_a_live_rank_is_409_naming_both(http):
    with live_addr() as a, live_addr() as b:
        http.post("/register", json=body(addr=a))
        r = http.post("/register", json=body(addr=b))
        assert r.status_code == 409
        assert a in r.json()["detail"] and b in r.json()["detail"]
        assert http.get("/query").json()["0"]["worker_addr"]["0"]["0"] == a


_RANKS = b'{"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, '
BAD_BODIES = [
    pytest.param(b'{"engine_id": "e", "dp_rank": 0,', 400, "not valid JSON", id="malformed-json"),
    pytest.param(b"", 400, "not valid JSON", id="empty-body"),
    pytest.param(b"[1, 2]", 422, "Expected `object`", id="not-an-object"),
    pytest.param(b'{"engine_id": "e", "dp_rank": "0", "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"}', 422, "dp_rank", id="string-rank"),
    pytest.param(b'{"engine_id": 7, "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"}', 422, "engine_id", id="int-engine-id"),
    pytest.param(b'{"engine_id": "e", "dp_rank": 0, "tp_rank": -1, "pp_rank": 0, "addr": "tcp://h:1"}', 422, "tp_rank", id="negative-rank"),
    pytest.param(b'{"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 1.5, "addr": "tcp://h:1"}', 422, "pp_rank", id="float-rank"),
    pytest.param(b'{"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0}', 422, "addr", id="missing-addr"),
    pytest.param(_RANKS + b'"addr": "10.0.0.1:5"}', 422, "tcp://host:port", id="addr-no-scheme"),
    pytest.param(_RANKS + b'"addr": "tcp://h:99999"}', 422, "tcp://host:port", id="addr-bad-port"),
    pytest.param(_RANKS + b'"addr": "tcp://h"}', 422, "tcp://host:port", id="addr-no-port"),
    pytest.param(_RANKS + b'"addr": "x" }' + b" " * 70000, 413, "larger than", id="too-large"),
]


@pytest.mark.parametrize(("raw", "status", "needle"), BAD_BODIES)
def test_bad_registrations_are_4xx_with_a_message_and_change_nothing(http, raw, status, needle):
    with live_addr() as a:
        http.post("/register", json=body(engine="keep", addr=a))
        before = http.get("/query").json()
        r = http.post("/register", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == status
        assert needle in r.json()["detail"]
        assert http.get("/query").json() == before
    assert metric(http, 'pdkv_bootstrap_rejects_total{reason="invalid"}') == 1


BAD_RANKS = [2**70, 65536, -1, True, 1.5, "0", None]


def test_ranks_outside_0_to_65536_are_refused_naming_the_field_and_change_nothing(http):
    with live_addr() as a:
        http.post("/register", json=body(engine="keep", addr=a))
        before, health = http.get("/query").json(), http.get("/health").json()
        refused = 0
        for field in ("dp_rank", "tp_rank", "pp_rank"):
            for value in BAD_RANKS:
                # The same engine and address, so only the rank could make it a new entry.
                r = http.post("/register", json={**body(engine="keep", addr=a), field: value})
                assert r.status_code == 422, (field, value, r.text)
                detail = r.json()["detail"]
                assert f"$.{field}" in detail and "\n" not in detail, detail
                refused += 1
        assert http.get("/query").json() == before
        assert http.get("/health").json() == health
        # The last rank inside the bound is a new worker of the same engine: the bound is not off by one.
        assert http.post("/register", json=body(engine="keep", tp=65535, addr=a)).status_code == 200
        assert http.get("/query").json()["0"]["worker_addr"]["65535"] == {"0": a}
    assert metric(http, 'pdkv_bootstrap_rejects_total{reason="invalid"}') == refused


# --- restart handling -------------------------------------------------------


def test_restarted_prefill_with_new_engine_id_replaces_the_dead_one(http):
    old = dead_addr()
    http.post("/register", json=body(engine="old", tp=0, addr=old))
    http.post("/register", json=body(engine="old", tp=1, addr=dead_addr()))
    with live_addr() as new:
        r = http.post("/register", json=body(engine="new", addr=new))
        assert r.status_code == 200 and r.json()["result"] == "replaced"
        assert http.get("/query").json() == {"0": {"engine_id": "new", "worker_addr": {"0": {"0": new}}}}


def test_restart_that_reuses_the_old_port_replaces_even_though_the_port_answers(http):
    with live_addr() as a:
        http.post("/register", json=body(engine="old", addr=a))
        # The newcomer holds the port now, so the old engine cannot: it is gone.
        r = http.post("/register", json=body(engine="new", addr=a))
        assert r.json()["result"] == "replaced"
        assert http.get("/query").json()["0"]["engine_id"] == "new"


def test_same_engine_moving_a_dead_worker_to_a_new_port_is_accepted(http):
    http.post("/register", json=body(addr=dead_addr()))
    with live_addr() as a:
        assert http.post("/register", json=body(addr=a)).json()["result"] == "replaced"
        assert http.get("/query").json()["0"]["worker_addr"] == {"0": {"0": a}}


def test_deregister_frees_the_rank_for_a_new_engine(server):
    with live_addr() as a, live_addr() as b, BootstrapClient(server.url) as client:
        client.register(RegisterRequest("old", 0, 0, 0, a))
        client.register(RegisterRequest("old", 1, 0, 0, b))
        assert client.deregister("old") == 2
        assert client.deregister("old") == 0
        assert client.query() == {}
        client.register(RegisterRequest("new", 0, 0, 0, b))
        assert client.query() == {0: EngineEntry("new", {"0": {"0": b}})}


def test_sweep_drops_a_dead_engine_and_keeps_a_live_one():
    probe = ProbePolicy(timeout=0.2, interval=0.05, failures=3)
    with start_background(probe=probe) as svc, BootstrapClient(svc.url) as client, live_addr() as keep:
        dying = socket.create_server(("127.0.0.1", 0))
        dying_addr = f"tcp://127.0.0.1:{dying.getsockname()[1]}"
        client.register(RegisterRequest("alive", 0, 0, 0, keep))
        client.register(RegisterRequest("dying", 1, 0, 0, dying_addr))
        time.sleep(0.3)  # several sweeps while both answer
        assert set(client.query()) == {0, 1}
        dying.close()
        assert wait_until(lambda: set(client.query()) == {0})
        assert svc.metrics.registry.get_sample_value("pdkv_bootstrap_evictions_total") == 1


def test_probing_does_not_disturb_a_zmq_router():
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        addr = f"tcp://127.0.0.1:{port}"
        probe = ProbePolicy(timeout=0.2, interval=0.02, failures=2)
        with start_background(probe=probe) as svc, BootstrapClient(svc.url) as client:
            client.register(RegisterRequest("zmq", 0, 0, 0, addr))
            time.sleep(0.3)  # about 15 probes
            assert client.query()[0].engine_id == "zmq"
        dealer.connect(addr)
        dealer.send(b"hello")
        assert router.poll(2000)
        assert router.recv_multipart()[1] == b"hello"
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()


# --- token, health, metrics -------------------------------------------------


def test_token_guards_register_and_deregister_but_not_query():
    with start_background(token="s3cret", probe=NO_SWEEP) as svc, live_addr() as a:
        with httpx.Client(base_url=svc.url, trust_env=False) as http:
            r = http.post("/register", json=body(addr=a))
            assert r.status_code == 401 and "no token" in r.json()["detail"]
            r = http.post("/register", json=body(addr=a), headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and "wrong token" in r.json()["detail"]
            assert http.post("/deregister", json={"engine_id": "eng-a"}).status_code == 401
            assert http.get("/query").json() == {}
            assert metric(http, 'pdkv_bootstrap_rejects_total{reason="unauthorized"}') == 3
        with pytest.raises(RemoteError) as info, BootstrapClient(svc.url) as anonymous:
            anonymous.register(RegisterRequest("eng-a", 0, 0, 0, a))
        assert info.value.status == 401 and "PDKV_TOKEN" in (info.value.hint or "")
        with BootstrapClient(svc.url, token="s3cret") as client:
            client.register(RegisterRequest("eng-a", 0, 0, 0, a))
            with BootstrapClient(svc.url) as anonymous:
                assert anonymous.query()[0].engine_id == "eng-a"
            assert client.deregister("eng-a") == 1


def test_health_and_metrics_count_what_happened(http):
    assert http.get("/health").json() == {"status": "ok", "engines": 0, "workers": 0}
    with live_addr() as a:
        http.post("/register", json=body(addr=a))
        http.post("/register", json=body(addr=a))
        http.post("/register", content=b"{")
        for _ in range(3):
            http.get("/query")
        http.post("/deregister", json={"engine_id": "nobody"})
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE pdkv_bootstrap_queries_total counter" in r.text
    assert metric(http, 'pdkv_bootstrap_registrations_total{result="created"}') == 1
    assert metric(http, 'pdkv_bootstrap_registrations_total{result="unchanged"}') == 1
    assert metric(http, 'pdkv_bootstrap_rejects_total{reason="invalid"}') == 1
    assert metric(http, "pdkv_bootstrap_queries_total") == 3
    assert metric(http, "pdkv_bootstrap_deregistrations_total") == 1
    assert metric(http, "pdkv_bootstrap_engines") == 1
    assert http.get("/health").json() == {"status": "ok", "engines": 1, "workers": 1}


# --- clients ----------------------------------------------------------------


def test_client_names_the_address_that_did_not_answer():
    url = "http://" + dead_addr().removeprefix("tcp://")
    client = BootstrapClient(url, timeout=0.5, retries=2)
    start = time.monotonic()
    with pytest.raises(UnreachableError) as info:
        client.query()
    assert time.monotonic() - start < 3
    assert info.value.message.startswith(f"bootstrap at {url} did not answer GET /query after 3 attempts")
    assert not client.health()
    client.close()


def test_client_timeout_is_bounded_when_the_server_never_answers():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connects, never replies
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with BootstrapClient(url, timeout=0.2, retries=1) as client:
            start = time.monotonic()
            with pytest.raises(UnreachableError, match="Timeout"):
                client.query()
            assert time.monotonic() - start < 2


def test_client_retries_until_the_server_comes_up():
    url_addr = dead_addr().removeprefix("tcp://")
    port = int(url_addr.rsplit(":", 1)[1])
    holder: list = []
    timer = threading.Timer(0.25, lambda: holder.append(start_background(port=port, probe=NO_SWEEP)))
    timer.start()
    try:
        with BootstrapClient(f"http://{url_addr}", timeout=1, retries=5) as client:
            assert client.query() == {}
    finally:
        timer.join()
        for svc in holder:
            svc.stop()


def test_client_retries_503_then_succeeds():
    calls = []

    async def flaky(request):
        calls.append(1)
        if len(calls) < 3:
            return web.Response(status=503)
        return web.json_response({"0": {"engine_id": "e", "worker_addr": {"0": {"0": "tcp://h:1"}}}})

    app = web.Application()
    app.router.add_get("/query", flaky)
    with BackgroundService(app) as svc, BootstrapClient(svc.url, retries=3) as client:
        assert client.query() == {0: EngineEntry("e", {"0": {"0": "tcp://h:1"}})}
    assert len(calls) == 3


def test_client_raises_registry_conflict_with_the_servers_message(server):
    with live_addr() as a, live_addr() as b, BootstrapClient(server.url) as client:
        client.register(RegisterRequest("eng-a", 0, 0, 0, a))
        client.register(RegisterRequest("eng-a", 0, 0, 0, a))
        with pytest.raises(RegistryConflict) as info:
            client.register(RegisterRequest("eng-b", 0, 0, 0, b))
    assert info.value.status == 409
    assert f"bootstrap at {server.url} refused POST /register (409)" in info.value.message
    assert "'eng-a'" in info.value.message and "'eng-b'" in info.value.message


def test_async_client_does_the_same(server):
    async def main():
        with live_addr() as a, live_addr() as b:
            async with AsyncBootstrapClient(server.url.removeprefix("http://") + "/") as client:
                assert await client.health()
                await client.register(RegisterRequest("eng-a", 0, 0, 0, a))
                await client.register(RegisterRequest("eng-a", 0, 1, 0, b))
                entries = await client.query()
                with pytest.raises(RegistryConflict):
                    await client.register(RegisterRequest("eng-b", 0, 0, 0, b))
                assert await client.deregister("eng-a") == 2
        async with AsyncBootstrapClient("http://" + dead_addr().removeprefix("tcp://"), timeout=0.3, retries=1) as gone:
            assert not await gone.health()
            with pytest.raises(UnreachableError, match="after 2 attempts"):
                await gone.query()
        return entries

    entries = asyncio.run(main())
    assert list(entries) == [0] and set(entries[0].worker_addr) == {"0", "1"}


def test_start_background_can_be_used_bare_or_as_a_context_manager():
    svc = start_background(probe=NO_SWEEP)
    try:
        with svc as same, BootstrapClient(svc.url) as client:
            assert same is svc
            assert client.health()
    finally:
        svc.stop()


# --- side by side with vLLM's own server -------------------------------------

VLLM_SERVER = """
import sys
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import MooncakeBootstrapServer
server = MooncakeBootstrapServer("127.0.0.1", 0)
server.start()
print(server.port, flush=True)
sys.stdin.read()
server.shutdown()
"""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_same_answers_as_vllms_own_bootstrap_server(server):
    proc = subprocess.Popen(
        [sys.executable, "-c", VLLM_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = proc.stdout.readline()  # vLLM's import takes several seconds
        assert line.strip().isdigit(), "vLLM's bootstrap server did not start"
        vllm_url = f"http://127.0.0.1:{line.strip()}"
        with live_addr() as a0, live_addr() as a1, live_addr() as b, live_addr() as c:
            steps = [
                body(engine="eng-a", tp=0, addr=a0),
                body(engine="eng-a", tp=0, addr=a0),  # identical again
                body(engine="eng-a", tp=1, addr=a1),
                body(engine="eng-b", tp=0, addr=b),  # another engine on a live dp rank
                body(engine="eng-a", tp=0, addr=b),  # another addr for a live rank
                body(engine="eng-b", dp=1, tp=0, pp=1, addr=c),
                b'{"engine_id": "x", "dp_rank": 0',
                {"engine_id": "x", "dp_rank": 0},
            ]
            answers = {}
            for url in (vllm_url, server.url):
                with httpx.Client(base_url=url, trust_env=False, timeout=10) as http:
                    classes = []
                    for step in steps:
                        r = http.post("/register", content=step) if isinstance(step, bytes) else http.post("/register", json=step)
                        classes.append(r.status_code // 100)
                    answers[url] = (classes, http.get("/query").json())
        assert answers[vllm_url][0] == [2, 2, 2, 4, 4, 2, 4, 4]
        assert answers[server.url] == answers[vllm_url]
        # pdkv's client reads vLLM's server, and says what it lacks.
        with BootstrapClient(vllm_url) as client:
            assert {dp: e.engine_id for dp, e in client.query().items()} == {0: "eng-a", 1: "eng-b"}
            with pytest.raises(RemoteError) as info:
                client.deregister("eng-a")
        assert info.value.status == 404 and "only /register and /query" in (info.value.hint or "")
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

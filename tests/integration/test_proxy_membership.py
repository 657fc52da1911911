"""The proxy following a real bootstrap server's members registry (stub P and D servers on 127.0.0.1):
servers that join take requests within seconds, servers that leave get none, a P and a D whose
compatibility keys disagree are never paired, and a backend that stops accepting connections is taken out
by the liveness probes. Every wait is bounded."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from pdkv.bootstrap import BootstrapClient, ProbePolicy, start_background
from pdkv.wire import MemberRecord, RegisterRequest
from pdkv.proxy.config import build_config
from pdkv.proxy.server import BackgroundProxy
from support.proxy_stubs import REQUEST, Stub
from support.waiting import wait_for

NO_SWEEP = ProbePolicy(interval=0)


class Fleet:
    """A members registry, stub servers that join it, and a proxy that knows nothing but the registry."""

    def __init__(self) -> None:
        self.registry = start_background(probe=NO_SWEEP)
        self.stubs: list[Stub] = []
        self.side: list = []  # each P's own vLLM-style bootstrap
        cfg = build_config([], [], members=[self.registry.url], port=0, health_interval=0.2, health_timeout=1.0,
                           unhealthy_after=1, members_interval=0.2, probe_interval=0.2)
        self.proxy = BackgroundProxy(cfg).start()

    def stub(self, name: str) -> Stub:
        s = Stub(name)
        s.service.start()
        self.stubs.append(s)
        return s

    def join_prefill(self, stub: Stub, engine: str, **key) -> MemberRecord:
        side = start_background(probe=NO_SWEEP)
        self.side.append(side)
        with BootstrapClient(side.url) as bs:
            bs.register(RegisterRequest(engine_id=engine, dp_rank=0, tp_rank=0, pp_rank=0, addr=f"tcp://127.0.0.1:{stub.service.port}"))
        rec = MemberRecord(member_id=engine, role="prefill", url=stub.url, bootstrap_url=side.url, **{**KEY, **key})
        self.join(rec)
        return rec

    def join_decode(self, stub: Stub, engine: str, **key) -> MemberRecord:
        rec = MemberRecord(member_id=engine, role="decode", url=stub.url, **{**KEY, **key})
        self.join(rec)
        return rec

    def join(self, rec: MemberRecord) -> None:
        with BootstrapClient(self.registry.url) as bs:
            bs.join(rec)

    def leave(self, member_id: str) -> None:
        with BootstrapClient(self.registry.url) as bs:
            bs.leave(member_id)

    def health(self) -> dict:
        return httpx.get(self.proxy.url + "/health", timeout=5, trust_env=False).json()

    def close(self) -> None:
        self.proxy.stop()
        for s in (*self.side, self.registry):
            s.stop()
        for stub in self.stubs:
            stub.service.stop()


KEY = {"model": "tiny", "block_size": 32, "tp_size": 1, "transport": "tcp"}


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


def complete(fleet: Fleet) -> httpx.Response:
    return httpx.post(fleet.proxy.url + "/v1/completions", json=REQUEST, timeout=10, trust_env=False)


def test_servers_that_join_take_requests_and_servers_that_leave_get_none(fleet: Fleet):
    assert fleet.health()["status"] == "unavailable"
    p, d1 = fleet.stub("p"), fleet.stub("d1")
    fleet.join_prefill(p, "engine-p")
    fleet.join_decode(d1, "engine-d1")
    started = time.monotonic()
    wait_for(lambda: fleet.health()["status"] == "ok", timeout=5.0, what="the joined P and D to become routable")
    assert time.monotonic() - started < 5.0
    assert complete(fleet).status_code == 200
    (_, d_body), = d1.seen
    assert d_body["kv_transfer_params"]["remote_engine_id"] == "engine-p"
    assert d_body["kv_transfer_params"]["remote_bootstrap_addr"] == fleet.side[0].url

    d2 = fleet.stub("d2")
    fleet.join_decode(d2, "engine-d2")
    wait_for(lambda: sum(b["up"] for b in fleet.health()["backends"] if b["role"] == "decode") == 2, what="the second D")
    for _ in range(6):
        assert complete(fleet).status_code == 200
    assert len(d2.seen) == 3 and len(d1.seen) == 4  # round-robin over both

    fleet.leave("engine-d1")
    wait_for(lambda: [b["url"] for b in fleet.health()["backends"] if b["role"] == "decode"] == [d2.url], what="D1 to go")
    before = len(d1.seen)
    for _ in range(4):
        assert complete(fleet).status_code == 200
    assert len(d1.seen) == before and len(d2.seen) == 7


def test_a_p_and_a_d_that_disagree_are_never_paired_and_health_says_why(fleet: Fleet):
    p, d16, d32 = fleet.stub("p"), fleet.stub("d16"), fleet.stub("d32")
    fleet.join_prefill(p, "engine-p")
    fleet.join_decode(d16, "engine-d16", block_size=16)
    wait_for(lambda: any(b["up"] for b in fleet.health()["backends"] if b["role"] == "decode"), what="D16 up")
    health = fleet.health()
    assert health["status"] == "unavailable" and "may be paired" in health["reason"]
    assert any("block size 16" in n and d16.url in n for n in health["notes"])
    assert complete(fleet).status_code in (200, 503)  # D alone computes it (local fallback), never paired with P
    assert all("kv_transfer_params" not in body for _, body in d16.seen)
    fleet.join_decode(d32, "engine-d32")
    wait_for(lambda: fleet.health()["status"] == "ok", what="the matching D")
    for _ in range(4):
        assert complete(fleet).status_code == 200
    assert len(d32.seen) == 4 and all("kv_transfer_params" not in body for _, body in d16.seen)


def test_a_backend_that_stops_accepting_connections_is_taken_out_by_the_probes(fleet: Fleet):
    p, d = fleet.stub("p"), fleet.stub("d")
    fleet.join_prefill(p, "engine-p")
    fleet.join_decode(d, "engine-d")
    wait_for(lambda: fleet.health()["status"] == "ok", what="P and D")
    d.service.stop()
    wait_for(lambda: fleet.health()["status"] == "unavailable", timeout=3.0, what="the probes to take D out")
    reason = next(b["reason"] for b in fleet.health()["backends"] if b["role"] == "decode")
    assert "unreachable" in reason or "/health" in reason

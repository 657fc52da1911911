"""run_bench over real Mooncake tcp on 127.0.0.1: a local child target, an in-thread `serve`, corruption caught."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pdkv.bench.control import BenchTarget, Checksum, Digest, Failed, Reply, TargetClient
from pdkv.bench.runner import BenchSpec, run_bench, settings_from_env
from pdkv.errors import RemoteError, StartError, TransferError, UnreachableError
from pdkv.geometry import dense_geometry, size_transfer

pytest.importorskip("mooncake")

TINY = dense_geometry(2, 2, 32, "bfloat16")  # the tiny model: 4,096 B per block per layer at block size 16
QUIET = settings_from_env()


def spec(**kw) -> BenchSpec:
    base = dict(geometry=TINY, blocks=[5], iters=3, warmup=1, settings=QUIET, transfer_engine_bench=False)
    base.update(kw)
    return BenchSpec(**base)


class CorruptingTarget(BenchTarget):
    """A real target whose memory gets one byte flipped in the first range before every checksum."""

    def handle(self, req):
        if isinstance(req, Checksum) and self.memory is not None:
            self.memory.flip(req.ranges[0][0] + 7)
        return super().handle(req)


def serve_in_thread(target: BenchTarget):
    stop = threading.Event()
    thread = threading.Thread(target=target.serve, kwargs={"stop": stop}, daemon=True)
    thread.start()
    return stop, thread


@pytest.fixture
def served():
    targets = []

    def start(cls=BenchTarget):
        t = cls("127.0.0.1", 0, settings=QUIET)
        stop, thread = serve_in_thread(t)
        targets.append((t, stop, thread))
        return t

    yield start
    for t, stop, thread in targets:
        stop.set()
        thread.join(5)
        t.close()


def test_local_target_all_layouts_verified_with_bare_baseline():
    report = run_bench(spec(layouts=["all"], baseline=True))
    assert [c.layout for c in report.cases] == ["contiguous", "per-block", "scattered"]
    want = size_transfer(TINY, prompt_tokens=5 * 16).transfer_bytes
    for c in report.cases:
        assert c.bytes == c.plan_bytes == want == 5 * 2 * 4096
        assert c.verified and c.timing.iters == 3 and c.cold_ms > 0
        assert c.timing.min_ms <= c.timing.p50_ms <= c.timing.p99_ms <= c.timing.max_ms
        assert c.baseline is not None and c.baseline.bare.iters == 3 and c.baseline.p50_ratio > 0
        assert c.baseline.teb_note == "not asked for"
    assert [c.descriptors for c in report.cases] == [2, 10, 10]
    assert report.peer.startswith("127.0.0.1:") and report.src == report.dst == "cpu"


def test_socket_is_measured_beside_mooncake_tcp_on_the_same_memory():
    report = run_bench(spec(transport="socket", layouts=["all"], baseline=True))
    assert report.transport == "socket" and report.peer.startswith("socket://127.0.0.1:")
    for c in report.cases:
        assert c.verified and c.baseline is not None and c.baseline.bare.iters == 3
        assert c.baseline.teb_note == "baseline: Mooncake tcp, the same descriptors between the same memory"
    assert int(report.mc_settings["connections"]) >= 1 and report.mc_settings["socket_buffer_bytes"] == str(96 << 10)


def test_socket_connections_and_buffers_are_the_ones_asked_for():
    report = run_bench(spec(transport="socket", connections=3, socket_buffer_bytes=1 << 20))
    assert report.mc_settings["connections"] == "3" and report.mc_settings["socket_buffer_bytes"] == str(1 << 20)
    assert report.cases[0].verified


def test_two_host_mode_against_serve(served):
    target = served()
    report = run_bench(spec(blocks=[1, 3], target=target.address, baseline=True, transfer_engine_bench=True))
    assert [(c.blocks, c.descriptors) for c in report.cases] == [(1, 2), (3, 2)]
    assert report.target == target.address
    assert all(c.baseline.teb_note == "not run in two-host mode" for c in report.cases)
    assert target.requests >= 6  # setup, refill + 2 checksums per case, bye


def test_corrupted_destination_is_caught(served):
    target = served(CorruptingTarget)
    with pytest.raises(TransferError, match="differ from the source") as info:
        run_bench(spec(target=target.address))
    assert "cold" in info.value.message


def test_target_refuses_ranges_outside_its_memory(served):
    target = served()
    with TargetClient(target.address, timeout_s=10) as client:
        ready = client.setup(2, 4096, 4, seed=1)
        inside = (ready.regions[0].base, 4096)
        assert isinstance(client.call(Checksum([inside])), Digest)
        with pytest.raises(RemoteError, match="outside"):
            client.checksum([(ready.regions[0].base + 3 * 4096, 8192)])


def send_raw(address: str, body: dict) -> object:
    """One request as a peer's bytes (unchecked by any Struct), and the target's decoded reply."""
    import msgspec
    import zmq

    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(f"tcp://{address}")
        sock.send(msgspec.msgpack.encode(body))
        return msgspec.msgpack.decode(sock.recv(), type=Reply)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"op": "setup", "layers": 0, "block_len": 4096, "num_blocks": 4, "seed": 1}, "$.layers"),
        ({"op": "setup", "layers": 2, "block_len": 4096, "num_blocks": 2**40, "seed": 1}, "$.num_blocks"),
        ({"op": "setup", "layers": 2, "block_len": 0, "num_blocks": 4, "seed": 1}, "$.block_len"),
        ({"op": "refill", "seed": -1}, "$.seed"),
        ({"op": "checksum", "ranges": [[2**64 - 8, 16]]}, "ends past 2**64"),
    ],
)
def test_out_of_range_requests_are_refused_and_change_nothing(served, body, needle):
    target = served()
    with TargetClient(target.address, timeout_s=10) as client:
        ready = client.setup(2, 4096, 4, seed=1)
        whole = [(r.base, r.size) for r in ready.regions]
        digest = client.checksum(whole)
        reply = send_raw(target.address, body)
        assert isinstance(reply, Failed) and needle in reply.message and "\n" not in reply.message, reply
        assert target.memory is not None and target.memory.regions == ready.regions
        assert client.checksum(whole) == digest


def test_unanswering_target_is_bounded():
    with socket.create_server(("127.0.0.1", 0)) as silent:
        start = time.monotonic()
        with TargetClient(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=1) as client, pytest.raises(UnreachableError):
            client.setup(1, 4096, 1, seed=0)
        assert time.monotonic() - start < 5


def test_rdma_without_a_device_fails_before_any_process_starts():
    # This host has no RDMA device: the child refuses rdma instead of silently using tcp.
    with pytest.raises(StartError, match="RDMA"):
        run_bench(spec(transport="rdma", device="mlx5_0"))


@pytest.mark.skipif(
    __import__("pdkv.bench.baseline", fromlist=["x"]).find_transfer_engine_bench() is None,
    reason="this Mooncake wheel ships no transfer_engine_bench",
)
def test_transfer_engine_bench_runs_alongside():
    report = run_bench(spec(blocks=[4], baseline=True, transfer_engine_bench=True, iters=2))
    b = report.cases[0].baseline
    assert b.teb_note is None and b.teb_gbps > 0 and b.teb_ratio == pytest.approx(report.cases[0].timing.gbps_p50 / b.teb_gbps)


def test_local_target_start_failure_is_reported_not_awaited():
    from pdkv.bench.runner import local_target

    start = time.monotonic()
    with pytest.raises(StartError, match="not a Mooncake setting"), local_target(spec(settings={"NOT_MC": "1"})):
        pass
    assert time.monotonic() - start < 30


def test_library_entry_point_without_the_cli():
    import json
    import subprocess
    import sys

    argv = [sys.executable, "-m", "pdkv.bench", "--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--blocks", "3"]
    done = subprocess.run([*argv, "--iters", "2", "--layout", "scattered"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    case = json.loads(done.stdout)["cases"][0]
    assert (case["layout"], case["descriptors"], case["verified"]) == ("scattered", 6, True)
    bad = subprocess.run([*argv, "--iters", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--iters" in bad.stderr


@pytest.mark.parametrize(("tp", "transport"), [((2, 1), "tcp"), ((1, 2), "tcp"), ((2, 1), "cma"), ((1, 2), "socket")])
def test_p_and_d_of_different_tp_move_d_rank_0s_heads_verified(tp, transport):
    from pdkv.geometry import rank_transfers

    report = run_bench(spec(tp=tp, transport=transport, layouts=["contiguous", "scattered"], block_size=32))
    plan = rank_transfers(TINY, *tp, prompt_tokens=5 * 32, block_size=32)
    want = {str(r.p_rank): r.bytes for r in plan if r.d_rank == 0}
    for case in report.cases:
        assert case.verified and case.rank_bytes == want
        assert case.bytes == case.plan_bytes == sum(want.values())
        assert case.descriptors == len(want) * TINY.layers * 5  # a share of every block: one per layer and block

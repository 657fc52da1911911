"""MooncakeTransport over real Mooncake tcp on 127.0.0.1: bytes verified, failures bounded."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import multiprocessing as mp
import socket
import threading
import time

import numpy as np
import pytest
from support.stopping import resume_process, stop_process

from pdkv.errors import StartError, TransferError, UsageError
from pdkv.transport import Descriptor, Transport, check_mooncake_transport, link_gbps_of, open_transport, plan_descriptors
from pdkv.transport.mooncake import MooncakeTransport
from pdkv.wire import Region

pytest.importorskip("mooncake")

QUIET = {"MC_LOG_LEVEL": "ERROR"}
BL = 4096  # bytes per block per layer
LAYERS, BLOCKS = 3, 8


def layer_regions(buf: np.ndarray) -> list[Region]:
    base = buf.ctypes.data
    return [Region(base + i * BLOCKS * BL, BL, BLOCKS) for i in range(LAYERS)]


def spans(buf: np.ndarray, regions: list[Region], blocks: list[int]) -> bytes:
    """The bytes of `blocks` in every region, in planning order."""
    base = buf.ctypes.data
    out = bytearray()
    for r in regions:
        for b in blocks:
            off = r.base - base + b * BL
            out += buf[off : off + BL].tobytes()
    return bytes(out)


@pytest.fixture
def pair():
    with MooncakeTransport(settings=QUIET) as p, MooncakeTransport(settings=QUIET) as d:
        src = np.random.default_rng(7).integers(0, 256, LAYERS * BLOCKS * BL, dtype=np.uint8)
        dst = np.zeros_like(src)
        p.register([(src.ctypes.data, src.nbytes)])
        d.register([(dst.ctypes.data, dst.nbytes)])
        yield p, d, src, dst


def test_is_a_transport_and_names_its_session(pair):
    p, d, _, _ = pair
    assert isinstance(p, Transport)
    host, port = p.session_address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert p.session_address != d.session_address


@pytest.mark.parametrize("coalesce", [True, False])
def test_write_lands_scattered_blocks_exactly(pair, coalesce):
    p, d, src, dst = pair
    local, remote = [0, 1, 2, 5, 7], [6, 7, 0, 1, 3]
    ds = plan_descriptors(local, remote, layer_regions(src), layer_regions(dst), coalesce=coalesce)
    assert len(ds) == LAYERS * (4 if coalesce else 5)
    p.write(d.session_address, ds)
    assert spans(dst, layer_regions(dst), remote) == spans(src, layer_regions(src), local)
    untouched = [b for b in range(BLOCKS) if b not in remote]
    assert not any(spans(dst, layer_regions(dst), untouched))


@pytest.mark.parametrize("n_blocks", [1, BLOCKS])
def test_every_write_has_landed_whole_when_write_returns(pair, n_blocks):
    # Fresh bytes each time, checked the moment write() returns: a write that reported done early
    # (Mooncake's transfer_check_status does, after a batch's first descriptor) would be caught.
    p, d, src, dst = pair
    p.write(d.session_address, [Descriptor(src.ctypes.data, dst.ctypes.data, BL)])
    rng = np.random.default_rng(3)
    for _ in range(20):
        local = [int(b) for b in rng.permutation(BLOCKS)[:n_blocks]]
        remote = [int(b) for b in rng.permutation(BLOCKS)[:n_blocks]]
        ds = plan_descriptors(local, remote, layer_regions(src), layer_regions(dst), coalesce=False)
        src[:] = rng.integers(0, 256, src.size, dtype=np.uint8)
        p.write(d.session_address, ds)
        assert spans(dst, layer_regions(dst), remote) == spans(src, layer_regions(src), local)


def _target(conn) -> None:
    with MooncakeTransport(settings=QUIET) as d:
        dst = np.zeros(LAYERS * BLOCKS * BL, dtype=np.uint8)
        d.register([(dst.ctypes.data, dst.nbytes)])
        conn.send((d.session_address, dst.ctypes.data))
        blocks = conn.recv()
        conn.send(hashlib.sha256(spans(dst, layer_regions(dst), blocks)).hexdigest())


@contextlib.contextmanager
def target_process():
    """A second process with a registered destination: yields (pipe, process, its session, its buffer's address)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(30), "target process did not start"
        peer, dst_base = parent.recv()
        yield parent, proc, peer, dst_base
    finally:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.join(10)


def test_write_across_two_processes():
    with target_process() as (parent, _, peer, dst_base):
        remote_regions = [Region(dst_base + i * BLOCKS * BL, BL, BLOCKS) for i in range(LAYERS)]
        with MooncakeTransport(settings=QUIET) as p:
            src = np.random.default_rng(1).integers(0, 256, LAYERS * BLOCKS * BL, dtype=np.uint8)
            p.register([(src.ctypes.data, src.nbytes)])
            local, remote = list(range(BLOCKS)), list(range(BLOCKS))
            p.write(peer, plan_descriptors(local, remote, layer_regions(src), remote_regions))
            parent.send(remote)
            assert parent.poll(30)
            assert parent.recv() == hashlib.sha256(spans(src, layer_regions(src), local)).hexdigest()


def test_write_to_a_peer_that_does_not_exist_fails_fast(pair):
    p, _, src, _ = pair
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(TransferError, match=rf"127\.0\.0\.1:{port}") as info:
        p.write(f"127.0.0.1:{port}", [Descriptor(src.ctypes.data, 1 << 30, 4096)])
    assert "4,096 B" in info.value.message
    assert time.monotonic() - start < 5


def test_write_to_a_silent_peer_is_bounded():
    # A listener that never answers stands for a stopped process: Mooncake's own handshake would wait 60 s.
    with MooncakeTransport(settings=QUIET, write_timeout_s=1.0) as p, socket.create_server(("127.0.0.1", 0)) as silent:
        src = np.zeros(4096, dtype=np.uint8)
        p.register([(src.ctypes.data, src.nbytes)])
        peer = f"127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(TransferError, match="no answer within 1 s"):
            p.write(peer, [Descriptor(src.ctypes.data, 1 << 30, 4096)])
        assert time.monotonic() - start < 3
    # Closing the listener resets the stalled handshake, so close() need not wait out its bound.
    assert time.monotonic() - start < 4


def test_a_peer_that_answered_once_then_stops_is_bounded_too():
    # A connection that worked, then a peer that stops (SIGSTOP): the write is bounded all the same.
    with target_process() as (_, proc, peer, dst_base), MooncakeTransport(settings=QUIET, write_timeout_s=1.0) as p:
        src = np.ones(4096, dtype=np.uint8)
        p.register([(src.ctypes.data, src.nbytes)])
        p.write(peer, [Descriptor(src.ctypes.data, dst_base, 4096)])
        p.write(peer, [Descriptor(src.ctypes.data, dst_base + 4096, 4096)])
        # Every thread stopped, not only signalled: until then its io thread can still take the write
        # and acknowledge it. A 4 KiB write fits the socket's buffers; it is Mooncake's acknowledgment
        # (sent once the bytes are in the peer's memory) that a stopped peer cannot give.
        stop_process(proc.pid)
        start = time.monotonic()
        with pytest.raises(TransferError, match="no answer within 1 s"):
            p.write(peer, [Descriptor(src.ctypes.data, dst_base, 4096)])
        assert time.monotonic() - start < 3


def test_a_write_that_timed_out_before_it_started_never_starts():
    # Two writes to a stopped peer: one in Mooncake's hands, one queued behind it; both callers are told they
    # failed. Once the peer resumes, the write in flight lands (it cannot be called back), but the queued one
    # must not run: its caller has been told it failed, and D may have given those blocks to another request.
    with target_process() as (parent, proc, peer, dst_base), MooncakeTransport(settings=QUIET, write_timeout_s=1.0) as p:
        src = np.ones(2 * BL, dtype=np.uint8)
        p.register([(src.ctypes.data, src.nbytes)])
        p.write(peer, [Descriptor(src.ctypes.data, dst_base, BL)])  # block 0: it answered once
        stop_process(proc.pid)
        try:
            outcomes = _concurrently([lambda b=b: p.write(peer, [Descriptor(src.ctypes.data, dst_base + b * BL, BL)]) for b in (1, 2)])
            assert all(isinstance(e, TransferError) and "no answer" in e.message for e in outcomes), outcomes
        finally:
            resume_process(proc.pid)
        p.close()  # joins the abandoned worker: whatever it was going to run has run
        parent.send([0, 1, 2])
        assert parent.poll(30)
        landed = parent.recv()

    def digest(blocks: tuple[int, ...]) -> str:
        mem = np.zeros(LAYERS * BLOCKS * BL, dtype=np.uint8)
        for b in blocks:
            mem[b * BL : (b + 1) * BL] = 1  # layer 0's block b
        return hashlib.sha256(spans(mem, layer_regions(mem), [0, 1, 2])).hexdigest()

    assert landed != digest((0, 1, 2)), "the write queued behind the stalled one ran after its caller was told it failed"
    assert landed in (digest((0, 1)), digest((0, 2)))


def test_a_rejected_write_after_an_answered_one_fails_and_the_next_lands(pair):
    p, d, src, dst = pair
    p.write(d.session_address, [Descriptor(src.ctypes.data, dst.ctypes.data, 4096)])
    beyond = dst.ctypes.data + dst.nbytes - 100
    with pytest.raises(TransferError, match="Mooncake returned"):
        p.write(d.session_address, [Descriptor(src.ctypes.data, beyond, 4096)])
    p.write(d.session_address, [Descriptor(src.ctypes.data + 4096, dst.ctypes.data + 4096, 4096)])  # and recovers
    assert bytes(dst[: 2 * 4096]) == bytes(src[: 2 * 4096])


def test_out_of_range_blocks_are_refused_before_any_write(pair):
    p, d, src, dst = pair
    with pytest.raises(TransferError, match="outside"):
        p.write(d.session_address, plan_descriptors([0, 1], [BLOCKS - 1, BLOCKS], layer_regions(src), layer_regions(dst)))
    assert not dst.any()


def test_destination_outside_registered_memory_is_rejected_by_the_peer(pair):
    p, d, src, dst = pair
    beyond = dst.ctypes.data + dst.nbytes - 100  # runs 3,996 B past the registered end
    with pytest.raises(TransferError, match="Mooncake returned"):
        p.write(d.session_address, [Descriptor(src.ctypes.data, beyond, 4096)])
    assert not dst.any()


def test_closed_transport_refuses_work():
    t = open_transport("tcp", "127.0.0.1", settings=QUIET)
    t.close()
    t.close()
    with pytest.raises(TransferError, match="closed"):
        t.write("127.0.0.1:1", [Descriptor(1, 1, 1)])


def test_rdma_without_a_device_is_refused_not_silently_tcp():
    with pytest.raises(StartError, match="RDMA"):
        MooncakeTransport(transport="rdma", device_name="mlx5_0", sysfs_root="/nonexistent/infiniband")


def test_rdma_device_names_are_checked_against_sysfs(tmp_path):
    # A fake sysfs tree: this host has no RDMA NIC.
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    check_mooncake_transport("rdma", "mlx5_0", tmp_path)
    with pytest.raises(StartError, match="mlx5_9 not found"):
        check_mooncake_transport("rdma", "mlx5_0,mlx5_9", tmp_path)
    assert link_gbps_of("mlx5_0", tmp_path) == 400.0
    assert link_gbps_of("mlx5_1", tmp_path) is None


def test_bad_transport_and_settings_are_usage_errors():
    with pytest.raises(UsageError, match="transport"):
        MooncakeTransport(transport="nvlink2")
    with pytest.raises(UsageError, match="not a Mooncake setting"):
        MooncakeTransport(settings={"LOG_LEVEL": "ERROR"})


def test_a_write_above_mooncakes_per_peer_queue_limit_lands():
    # 2,300 descriptors exceed Mooncake's default queue of 2,048 per peer (one uncut call can be
    # refused with "queue-full", depending on how fast the queue drains); the transport cuts the write.
    n, size = 2300, 256
    with MooncakeTransport(settings=QUIET) as p, MooncakeTransport(settings=QUIET) as d:
        src = np.random.default_rng(5).integers(0, 256, n * size, dtype=np.uint8)
        dst = np.zeros_like(src)
        p.register([(src.ctypes.data, src.nbytes)])
        d.register([(dst.ctypes.data, dst.nbytes)])
        # Reversed order, so that nothing could be merged into longer writes.
        ds = [Descriptor(src.ctypes.data + i * size, dst.ctypes.data + (n - 1 - i) * size, size) for i in range(n)]
        assert p.max_batch < 2048
        p.write(d.session_address, ds)
        assert np.array_equal(dst.reshape(n, size), src.reshape(n, size)[::-1])


def _concurrently(fns: list) -> list[BaseException | None]:
    """Call every function at once, one thread each; each one's exception or None."""
    start = threading.Barrier(len(fns))

    def run(fn) -> BaseException | None:
        start.wait(10)
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            return exc
        return None

    with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(run, fns, timeout=120))


def test_16_concurrent_writes_into_one_peer_each_land_in_their_own_blocks():
    wide = 32  # 16 requests of 2 blocks each
    rng = np.random.default_rng(5)
    with MooncakeTransport(settings=QUIET) as p, MooncakeTransport(settings=QUIET) as d:
        src = rng.integers(0, 256, LAYERS * wide * BL, dtype=np.uint8)
        dst = np.zeros_like(src)
        p.register([(src.ctypes.data, src.nbytes)])
        d.register([(dst.ctypes.data, dst.nbytes)])
        regions = lambda buf: [Region(buf.ctypes.data + i * wide * BL, BL, wide) for i in range(LAYERS)]  # noqa: E731
        for _ in range(3):
            remote = rng.permutation(wide).reshape(16, 2)
            local = rng.integers(0, wide, (16, 2))
            plans = [
                plan_descriptors([int(b) for b in local[i]], [int(b) for b in remote[i]], regions(src), regions(dst)) for i in range(16)
            ]
            assert _concurrently([lambda ds=ds: p.write(d.session_address, ds) for ds in plans]) == [None] * 16
            for i in range(16):
                for r_src, r_dst in zip(regions(src), regions(dst), strict=True):
                    for lb, rb in zip(local[i], remote[i], strict=True):
                        s_off, d_off = r_src.base - src.ctypes.data + int(lb) * BL, r_dst.base - dst.ctypes.data + int(rb) * BL
                        assert dst[d_off : d_off + BL].tobytes() == src[s_off : s_off + BL].tobytes()


def test_a_stalled_peer_does_not_delay_writes_to_another():
    # One D stopped (SIGSTOP) with writes to it in flight: writes to a healthy D still land at once.
    with target_process() as (_, proc, stalled, stalled_base), MooncakeTransport(settings=QUIET, write_timeout_s=3.0) as p, \
            MooncakeTransport(settings=QUIET) as d:
        src = np.ones(8 * 4096, dtype=np.uint8)
        dst = np.zeros_like(src)
        p.register([(src.ctypes.data, src.nbytes)])
        d.register([(dst.ctypes.data, dst.nbytes)])
        p.write(stalled, [Descriptor(src.ctypes.data, stalled_base, 4096)])  # it answered once
        stop_process(proc.pid)
        healthy_s: list[float] = []

        def to_stalled() -> None:
            p.write(stalled, [Descriptor(src.ctypes.data, stalled_base, 4096)])

        def to_healthy(i: int) -> None:
            time.sleep(0.3)  # the stalled writes are queued first
            t0 = time.monotonic()
            p.write(d.session_address, [Descriptor(src.ctypes.data + i * 4096, dst.ctypes.data + i * 4096, 4096)])
            healthy_s.append(time.monotonic() - t0)

        outcomes = _concurrently([to_stalled] * 4 + [lambda i=i: to_healthy(i) for i in range(8)])
        assert all(isinstance(e, TransferError) and "no answer" in e.message for e in outcomes[:4]), outcomes[:4]
        assert outcomes[4:] == [None] * 8
        assert max(healthy_s) < 1.0, healthy_s  # the stalled writes take 3 s each
        assert dst.all()


def test_close_waits_for_writes_in_flight_before_unregistering():
    with target_process() as (parent, _, peer, dst_base):
        p = MooncakeTransport(settings=QUIET)
        src = np.random.default_rng(2).integers(0, 256, LAYERS * BLOCKS * BL, dtype=np.uint8)
        p.register([(src.ctypes.data, src.nbytes)])
        remote_regions = [Region(dst_base + i * BLOCKS * BL, BL, BLOCKS) for i in range(LAYERS)]
        ds = plan_descriptors(list(range(BLOCKS)), list(range(BLOCKS)), layer_regions(src), remote_regions, coalesce=False)
        writer = threading.Thread(target=lambda: _concurrently([lambda: p.write(peer, ds)] * 4))
        writer.start()
        time.sleep(0.05)
        p.close()
        writer.join(30)
        assert not writer.is_alive()
        with pytest.raises(TransferError, match="closed"):
            p.write(peer, ds)
        parent.send(list(range(BLOCKS)))
        assert parent.poll(30)
        assert parent.recv() == hashlib.sha256(spans(src, layer_regions(src), list(range(BLOCKS)))).hexdigest()

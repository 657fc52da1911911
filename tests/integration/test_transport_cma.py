"""CmaTransport between real processes of this host: bytes verified, bad peers and bad ranges refused."""

from __future__ import annotations

import concurrent.futures
import hashlib
import multiprocessing as mp
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from pdkv.errors import StartError, TransferError
from pdkv.transport import Descriptor, Transport, open_transport, plan_descriptors
from pdkv.transport.cma import IOV_MAX, CmaTransport, parse_session, process_start_time
from pdkv.wire import Region

BL = 4096
LAYERS, BLOCKS = 3, 8
SIZE = LAYERS * BLOCKS * BL


def _decode_main(conn, blocks: int) -> None:
    """A decode process: registered zeroed memory; answers (session, base) and then its bytes on request."""
    mem = np.zeros(LAYERS * blocks * BL, dtype=np.uint8)
    with CmaTransport() as t:
        t.register([(mem.ctypes.data, mem.nbytes)])
        conn.send((t.session_address, mem.ctypes.data))
        while True:
            msg = conn.recv()
            if msg == "stop":
                return
            if msg == "bytes":
                conn.send(mem.tobytes())


class Decode:
    def __init__(self, blocks: int = BLOCKS) -> None:
        ctx = mp.get_context("fork")
        self.blocks = blocks
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_main, args=(child, blocks), daemon=True)
        self.proc.start()
        assert self.conn.poll(10), "decode process did not start"
        self.session, self.base = self.conn.recv()

    @property
    def regions(self) -> list[Region]:
        return [Region(self.base + i * self.blocks * BL, BL, self.blocks) for i in range(LAYERS)]

    def memory(self) -> np.ndarray:
        self.conn.send("bytes")
        assert self.conn.poll(10)
        return np.frombuffer(self.conn.recv(), dtype=np.uint8)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("stop")
        self.proc.join(10)


@pytest.fixture
def decode():
    d = Decode()
    yield d
    d.stop()


@pytest.fixture
def prefill():
    src = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
    with open_transport("cma") as t:
        t.register([(src.ctypes.data, src.nbytes)])
        yield t, src


def local_regions(src: np.ndarray, blocks: int = BLOCKS) -> list[Region]:
    return [Region(src.ctypes.data + i * blocks * BL, BL, blocks) for i in range(LAYERS)]


def block_bytes(mem: np.ndarray, layer: int, b: int, blocks: int = BLOCKS) -> bytes:
    off = (layer * blocks + b) * BL
    return mem[off : off + BL].tobytes()


def test_is_a_transport_and_names_this_process(prefill):
    t, _ = prefill
    assert isinstance(t, Transport)
    boot, pid, start = parse_session(t.session_address)
    assert pid == os.getpid() and start == process_start_time(pid)
    assert boot == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@pytest.mark.parametrize("coalesce", [True, False])
def test_write_lands_scattered_blocks_exactly_in_another_process(prefill, decode, coalesce):
    t, src = prefill
    local, remote = [0, 1, 2, 5, 7], [6, 7, 0, 1, 3]
    ds = plan_descriptors(local, remote, local_regions(src), decode.regions, coalesce=coalesce)
    t.write(decode.session, ds)
    mem = decode.memory()
    for layer in range(LAYERS):
        for lb, rb in zip(local, remote, strict=True):
            assert block_bytes(mem, layer, rb) == block_bytes(src, layer, lb)
        for b in set(range(BLOCKS)) - set(remote):
            assert not any(block_bytes(mem, layer, b)), f"layer {layer} block {b} was written"


def test_more_descriptors_than_one_system_call_takes(prefill, decode):
    # 16-byte descriptors, more than IOV_MAX of them: the write is cut into several calls, all land.
    t, src = prefill
    n = IOV_MAX * 2 + 17
    ds = [Descriptor(src.ctypes.data + 32 * i, decode.base + 32 * i + 16, 16) for i in range(n)]
    t.write(decode.session, ds)
    mem = decode.memory()
    got = b"".join(mem[32 * i + 16 : 32 * i + 32].tobytes() for i in range(n))
    want = b"".join(src[32 * i : 32 * i + 16].tobytes() for i in range(n))
    assert hashlib.blake2b(got).digest() == hashlib.blake2b(want).digest()
    assert not mem[:16].any()


def test_every_write_has_landed_when_write_returns(prefill, decode):
    t, src = prefill
    for i in range(20):
        src[:BL] = i + 1  # fresh bytes each time
        t.write(decode.session, [Descriptor(src.ctypes.data, decode.base, BL)])
        assert (decode.memory()[:BL] == i + 1).all()


def test_local_range_outside_registered_memory_is_refused_before_any_byte(prefill, decode):
    t, src = prefill
    outside = np.ones(BL, dtype=np.uint8)
    ok = Descriptor(src.ctypes.data, decode.base, BL)
    for bad in (Descriptor(outside.ctypes.data, decode.base + BL, BL), Descriptor(src.ctypes.data + SIZE - 8, decode.base + BL, 16)):
        with pytest.raises(TransferError, match="outside the registered memory"):
            t.write(decode.session, [ok, bad])
    assert not decode.memory().any()


def test_remote_range_outside_the_peers_memory_fails_clearly(prefill, decode):
    t, src = prefill
    with pytest.raises(TransferError, match="process_vm_writev"):
        t.write(decode.session, [Descriptor(src.ctypes.data, 8, BL)])  # page 0 is never mapped


def test_a_peer_that_exited_is_refused(prefill, decode):
    t, src = prefill
    d = [Descriptor(src.ctypes.data, decode.base, BL)]
    t.write(decode.session, d)
    decode.proc.kill()
    decode.proc.join(10)
    with pytest.raises(TransferError, match="exited|does not exist"):
        t.write(decode.session, d)
    with pytest.raises(TransferError, match="exited|does not exist"):
        t.write(decode.session, d)  # and again, with the peer forgotten


def test_a_pid_that_now_belongs_to_another_process_is_refused(prefill, decode):
    t, src = prefill
    boot, pid, start = parse_session(decode.session)
    with pytest.raises(TransferError, match="pid was reused"):
        t.write(f"cma:{boot}:{pid}:{start + 1}", [Descriptor(src.ctypes.data, decode.base, BL)])
    assert not decode.memory().any()


@pytest.mark.parametrize("session", ["127.0.0.1:1234", "cma:x:y:z", "cma:boot:0:1", "cma:a:b"])
def test_malformed_session_is_refused(prefill, session):
    t, src = prefill
    with pytest.raises(TransferError, match="session address|names no process"):
        t.write(session, [Descriptor(src.ctypes.data, src.ctypes.data, BL)])


def test_a_peer_on_another_host_is_refused(prefill, decode):
    t, src = prefill
    _, pid, start = parse_session(decode.session)
    with pytest.raises(TransferError, match="another host"):
        t.write(f"cma:not-this-boot:{pid}:{start}", [Descriptor(src.ctypes.data, decode.base, BL)])


@pytest.mark.parametrize("scope", ["2", "3"])
def test_yama_scopes_that_forbid_attaching_refuse_to_start(tmp_path, scope):
    yama = tmp_path / "sys/kernel/yama"
    yama.mkdir(parents=True)
    (yama / "ptrace_scope").write_text(scope + "\n")
    with pytest.raises(StartError, match=f"ptrace_scope is {scope}"):
        CmaTransport(proc_root=tmp_path)


def test_write_after_close_is_refused(decode):
    src = np.ones(BL, dtype=np.uint8)
    t = CmaTransport()
    t.register([(src.ctypes.data, src.nbytes)])
    t.close()
    with pytest.raises(TransferError, match="closed"):
        t.write(decode.session, [Descriptor(src.ctypes.data, decode.base, BL)])


def test_a_negative_remote_address_is_a_transfer_error(prefill, decode):
    # A hostile pull could name regions below address 0: refused as a transfer error, nothing written.
    t, src = prefill
    with pytest.raises(TransferError, match="outside 0..2\\*\\*64"):
        t.write(decode.session, [Descriptor(src.ctypes.data, -4096, BL)])
    assert not decode.memory().any()



def _write_from_threads(t: CmaTransport, jobs: list[tuple[str, list[Descriptor]]]) -> list[BaseException | None]:
    """Every job's `t.write(session, descriptors)`, all started at once, one thread each; each job's outcome."""
    start = threading.Barrier(len(jobs))

    def run(job: tuple[str, list[Descriptor]]) -> BaseException | None:
        start.wait(10)
        try:
            t.write(*job)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            return exc
        return None

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs, timeout=60))


WIDE = 64  # blocks per layer for the concurrency tests: 32 requests of 2 blocks each


def test_32_concurrent_writes_into_one_peer_each_land_in_their_own_blocks():
    # 32 requests in flight to one D: each one's blocks land whole, in its own destination blocks, rounds on end.
    rng = np.random.default_rng(11)
    d = Decode(WIDE)
    try:
        with CmaTransport() as t:
            src = rng.integers(0, 256, LAYERS * WIDE * BL, dtype=np.uint8)
            t.register([(src.ctypes.data, src.nbytes)])
            for _ in range(5):
                dst = rng.permutation(WIDE).reshape(32, 2)  # disjoint destinations, a fresh scatter each round
                srcb = rng.integers(0, WIDE, (32, 2))  # source blocks may overlap between requests
                jobs = [
                    (d.session, plan_descriptors([int(b) for b in srcb[i]], [int(b) for b in dst[i]], local_regions(src, WIDE), d.regions))
                    for i in range(32)
                ]
                assert _write_from_threads(t, jobs) == [None] * 32
                mem = d.memory()
                for i in range(32):
                    for layer in range(LAYERS):
                        for lb, rb in zip(srcb[i], dst[i], strict=True):
                            assert block_bytes(mem, layer, int(rb), WIDE) == block_bytes(src, layer, int(lb), WIDE)
    finally:
        d.stop()


def test_a_peer_killed_under_concurrent_writes_fails_them_cleanly_and_another_peer_keeps_landing():
    rng = np.random.default_rng(12)
    dying, alive = Decode(WIDE), Decode(WIDE)
    try:
        with CmaTransport() as t:
            src = rng.integers(0, 256, LAYERS * WIDE * BL, dtype=np.uint8)
            t.register([(src.ctypes.data, src.nbytes)])
            blocks = list(range(WIDE))

            def jobs(peer: Decode) -> list[tuple[str, list[Descriptor]]]:
                return [(peer.session, plan_descriptors(blocks, blocks, local_regions(src, WIDE), peer.regions, coalesce=False))] * 16

            assert _write_from_threads(t, jobs(dying) + jobs(alive)) == [None] * 32
            dying.proc.kill()
            dying.proc.join(10)
            outcomes = _write_from_threads(t, jobs(dying) + jobs(alive))
            assert all(isinstance(e, TransferError) and "exited" in e.message for e in outcomes[:16]), outcomes[:16]
            assert outcomes[16:] == [None] * 16
            mem = alive.memory()
            assert mem.tobytes() == src.tobytes()
    finally:
        dying.stop()
        alive.stop()

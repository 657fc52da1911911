"""The socket transport with KV in GPU memory: staged through pinned buffers on both sides, bytes verified.

D runs in a child process (its own CUDA context, as an engine's worker), P in the test's. Runs only where CUDA
GPUs exist (marker `gpu`).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

pytestmark = pytest.mark.gpu

LAYERS, BLOCKS, BLOCK_LEN = 4, 64, 64 * 1024
CHUNK = 1 << 20  # small staging buffers, so one write crosses many of them and both double buffers turn over


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def _decode_side(conn, dst: str, engine: str = "kernel") -> None:
    import torch

    from pdkv.transport import block_spans
    from pdkv.transport.sockets import SocketTransport
    from pdkv.wire import Region

    gpu = int(dst[5:]) if dst.startswith("cuda:") else None
    kv = [torch.zeros(BLOCKS * BLOCK_LEN, dtype=torch.uint8, device=dst) for _ in range(LAYERS)]
    regions = [Region(x.data_ptr(), BLOCK_LEN, BLOCKS) for x in kv]
    with SocketTransport("127.0.0.1", gpu=gpu, chunk_bytes=CHUNK, write_timeout_s=10, staging=engine) as t:
        t.register([(x.data_ptr(), x.numel()) for x in kv])
        conn.send((t.session_address, [x.data_ptr() for x in kv]))
        while (msg := conn.recv()) != "stop":
            op, key, blocks = msg
            if op == "expect":
                t.expect(key, block_spans(blocks, regions))
                conn.send("ok")
            elif op == "sums":
                if gpu is not None:
                    torch.cuda.synchronize(gpu)
                conn.send([int(x.view(BLOCKS, BLOCK_LEN)[blocks].to(torch.int64).sum()) for x in kv])


class _Decode:
    """D in a child process running `side(conn, dst, engine)`, which first sends (session, bases), then answers each
    message until "stop"."""

    def __init__(self, dst: str, side=_decode_side, engine: str = "kernel") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=side, args=(child, dst, engine), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), "the decode side did not start in time"
        self.session, self.bases = self.conn.recv()

    def ask(self, *msg):
        self.conn.send(msg)
        assert self.conn.poll(60), f"the decode side did not answer {msg[0]}"
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _writes_land_and_strays_are_refused(torch, p, d: _Decode, kv: list) -> None:
    """Two transfers of blocks (a run, and scattered ones) through P's transport `p` land byte for byte in D; a
    block the pull did not announce is refused before a byte lands (D's block keeps its zeros)."""
    from pdkv.errors import TransferError
    from pdkv.wire import Region

    local = [Region(x.data_ptr(), BLOCK_LEN, BLOCKS) for x in kv]
    remote = [Region(b, BLOCK_LEN, BLOCKS) for b in d.bases]
    for key, lblocks, rblocks in (("a", list(range(40)), list(range(10, 50))), ("b", [3, 9, 4, 20], [60, 1, 7, 33])):
        assert d.ask("expect", key, rblocks) == "ok"
        written = p.write_blocks(d.session, lblocks, rblocks, local, remote, transfer=key)
        assert written.bytes == LAYERS * len(lblocks) * BLOCK_LEN
        want = [int(x.view(BLOCKS, BLOCK_LEN)[lblocks].to(torch.int64).sum()) for x in kv]
        assert d.ask("sums", "", rblocks) == want
    assert d.ask("expect", "c", [0]) == "ok"
    with pytest.raises(TransferError, match="outside what transfer"):
        p.write_blocks(d.session, [5], [63], local, remote, transfer="c")
    assert d.ask("sums", "", [63]) == [0] * LAYERS


@pytest.mark.parametrize("engine", ["kernel", "copies"])
@pytest.mark.parametrize("src,dst", [("cuda:0", "cuda:0"), ("cuda:0", "cpu"), ("cpu", "cuda:0"), ("cuda:0", "cuda:1")])
def test_gpu_memory_lands_exactly_through_the_staging(src: str, dst: str, engine: str) -> None:
    torch = _torch()
    if "cuda:1" in (src, dst) and torch.cuda.device_count() < 2:
        pytest.skip("one GPU only")
    from pdkv.transport.sockets import SocketTransport

    d = _Decode(dst, engine=engine)
    try:
        gen = torch.Generator(device=src).manual_seed(0)
        kv = [torch.randint(0, 256, (BLOCKS * BLOCK_LEN,), dtype=torch.uint8, device=src, generator=gen) for _ in range(LAYERS)]
        gpu = int(src[5:]) if src.startswith("cuda:") else None
        with SocketTransport("127.0.0.1", gpu=gpu, writable=False, chunk_bytes=CHUNK, connections=3, write_timeout_s=10,
                             staging=engine) as p:
            p.register([(x.data_ptr(), x.numel()) for x in kv])
            _writes_land_and_strays_are_refused(torch, p, d, kv)
    finally:
        d.close()


def _decode_ranges(conn, dst: str, engine: str = "kernel") -> None:
    """D for raw ranges: one span of `dst` granted whole; answers every message with a copy of it."""
    import torch

    from pdkv.transport.sockets import SocketTransport

    kv = torch.zeros(BLOCKS * BLOCK_LEN, dtype=torch.uint8, device=dst)
    with SocketTransport("127.0.0.1", gpu=int(dst[5:]), chunk_bytes=CHUNK, write_timeout_s=10, staging=engine) as t:
        t.register([(kv.data_ptr(), kv.numel())])
        t.expect("r", [(kv.data_ptr(), kv.numel())])
        conn.send((t.session_address, [kv.data_ptr()]))
        while conn.recv() != "stop":
            torch.cuda.synchronize()
            conn.send(kv.cpu().numpy().tobytes())


@pytest.mark.parametrize("engine", ["kernel", "copies"])
def test_small_and_unaligned_gpu_ranges_land_exactly(engine: str) -> None:
    """Thousands of 256-byte ranges (a batch is cut where its rows fill the captured launch, before its bytes fill the
    buffer) and ranges off the kernel's 16-byte alignment (copied a range at a time) land byte for byte."""
    torch = _torch()
    from pdkv.transport.base import Descriptor
    from pdkv.transport.sockets import SocketTransport
    from pdkv.transport.sockets.staging import MAX_ROWS, packed

    d = _Decode("cuda:0", _decode_ranges, engine)
    try:
        (base,) = d.bases
        size = BLOCKS * BLOCK_LEN
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(1))
        p0 = src.data_ptr()
        small = [Descriptor(p0 + k * 512, base + size - (k + 1) * 512, 256) for k in range(3000)]  # reversed on D
        odd = [Descriptor(p0 + 8 + k * 4096, base + 3 + k * 4096, 1000 + k) for k in range(100, 140)]
        assert len(packed([(r.src, r.length) for r in small], CHUNK)[0]) == MAX_ROWS  # the rows end the first batch
        with SocketTransport("127.0.0.1", gpu=0, writable=False, chunk_bytes=CHUNK, connections=2, write_timeout_s=10,
                             staging=engine) as p:
            p.register([(p0, size)])
            p.write(d.session, small + odd, transfer="r")
        got = torch.frombuffer(bytearray(d.ask("bytes")), dtype=torch.uint8)
        want = torch.zeros(size, dtype=torch.uint8)
        host = src.cpu()
        for r in small + odd:
            want[r.dst - base : r.dst - base + r.length] = host[r.src - p0 : r.src - p0 + r.length]
        assert torch.equal(got, want)
    finally:
        d.close()


def test_a_gpu_write_to_a_killed_decode_fails_at_once_and_the_next_decode_is_served() -> None:
    """D killed after it announced: P's staged write fails within seconds (not at its 30 s bound), and the same P
    transport then serves a new D."""
    torch = _torch()
    from pdkv.errors import TransferError
    from pdkv.wire import Region
    from pdkv.transport.sockets import SocketTransport

    kv = [torch.ones(BLOCKS * BLOCK_LEN, dtype=torch.uint8, device="cuda:0") for _ in range(LAYERS)]
    local = [Region(x.data_ptr(), BLOCK_LEN, BLOCKS) for x in kv]
    blocks = list(range(BLOCKS))
    with SocketTransport("127.0.0.1", gpu=0, writable=False, chunk_bytes=CHUNK, write_timeout_s=30) as p:
        p.register([(x.data_ptr(), x.numel()) for x in kv])
        d = _Decode("cuda:0")
        try:
            remote = [Region(b, BLOCK_LEN, BLOCKS) for b in d.bases]
            assert d.ask("expect", "k", blocks) == "ok"
            p.write_blocks(d.session, blocks, blocks, local, remote, transfer="k")  # connections made, kept
            d.proc.kill()
            d.proc.join(30)
            t0 = time.monotonic()
            with pytest.raises(TransferError):
                p.write_blocks(d.session, blocks, blocks, local, remote, transfer="k")
            assert time.monotonic() - t0 < 5
        finally:
            d.proc.join(30)
        d2 = _Decode("cuda:0")
        try:
            remote = [Region(b, BLOCK_LEN, BLOCKS) for b in d2.bases]
            assert d2.ask("expect", "k", blocks) == "ok"
            p.write_blocks(d2.session, blocks, blocks, local, remote, transfer="k")
            assert d2.ask("sums", "", blocks) == [BLOCKS * BLOCK_LEN] * LAYERS
        finally:
            d2.close()


def _until_ready(p, timeout_s: float = 60.0) -> None:
    assert p.await_send_process(timeout_s) == "ready", p.settings


@pytest.mark.parametrize("dst", ["cuda:0", "cpu"])
def test_p_s_send_process_writes_its_gpu_memory_byte_for_byte_and_ends_with_the_transport(dst: str) -> None:
    """socket_send_process: the child opens P's KV (CUDA IPC) and writes it, scattered blocks landing exactly; a block
    D did not announce is refused there as here; closing P's transport ends the child."""
    torch = _torch()
    from pdkv.transport.sockets import SocketTransport

    d = _Decode(dst)
    try:
        gen = torch.Generator(device="cuda:0").manual_seed(2)
        kv = [torch.randint(0, 256, (BLOCKS * BLOCK_LEN,), dtype=torch.uint8, device="cuda:0", generator=gen) for _ in range(LAYERS)]
        with SocketTransport("127.0.0.1", gpu=0, writable=False, chunk_bytes=CHUNK, connections=3, write_timeout_s=10,
                             send_process=True) as p:
            p.register([(x.data_ptr(), x.numel()) for x in kv])
            _until_ready(p)
            child = p._sender.proc
            _writes_land_and_strays_are_refused(torch, p, d, kv)
            assert p.settings["send_process"] == "ready" and child.poll() is None
        assert child.wait(10) is not None
    finally:
        d.close()


def test_a_killed_send_process_fails_no_later_write_p_writes_itself_from_then_on() -> None:
    """The child killed: P notices, logs it, and its next writes run in its own process and land."""
    torch = _torch()
    from pdkv.wire import Region
    from pdkv.transport.sockets import SocketTransport

    d = _Decode("cuda:0")
    try:
        kv = [torch.full((BLOCKS * BLOCK_LEN,), 3, dtype=torch.uint8, device="cuda:0") for _ in range(LAYERS)]
        local = [Region(x.data_ptr(), BLOCK_LEN, BLOCKS) for x in kv]
        remote = [Region(b, BLOCK_LEN, BLOCKS) for b in d.bases]
        blocks = list(range(8))
        with SocketTransport("127.0.0.1", gpu=0, writable=False, chunk_bytes=CHUNK, write_timeout_s=10, send_process=True) as p:
            p.register([(x.data_ptr(), x.numel()) for x in kv])
            _until_ready(p)
            p._sender.proc.kill()
            p._sender.proc.wait(10)
            end = time.monotonic() + 10
            while p.settings["send_process"] == "ready":
                assert time.monotonic() < end, "P did not notice its send process died"
                time.sleep(0.05)
            assert d.ask("expect", "k", blocks) == "ok"
            p.write_blocks(d.session, blocks, blocks, local, remote, transfer="k")
            assert d.ask("sums", "", blocks) == [3 * BLOCK_LEN * len(blocks)] * LAYERS
    finally:
        d.close()

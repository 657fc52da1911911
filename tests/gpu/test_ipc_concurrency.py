"""CUDA IPC under concurrent transfers: 32 requests from 32 threads, the seed's Qwen3-8B geometry (36 layers,
64 KiB per layer per block, 63 blocks each), every destination block checked against its source.

D's memory is GPU 1's where two GPUs are visible, else GPU 0's in another process (CUDA IPC still crosses the
process boundary). Marker `gpu`: skipped where no GPU exists. Also: a D killed in the middle of concurrent
transfers to it and to another D.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

pytestmark = pytest.mark.gpu

LAYERS, BLOCK_LEN, PER_REQUEST, REQUESTS = 36, 64 * 1024, 63, 32
D_BLOCKS = PER_REQUEST * REQUESTS  # every request writes blocks of its own
P_BLOCKS = 256


def _digests(layers, blocks):
    """Two checksums per (layer, block): the int64 sum and a position-weighted sum of its words."""
    import torch

    out = []
    for x in layers:
        words = x.view(-1, BLOCK_LEN)[blocks].view(torch.int64)
        weights = torch.arange(1, words.shape[1] + 1, device=words.device, dtype=torch.int64)
        out.append(torch.stack([words.sum(dim=1), (words * weights).sum(dim=1)], dim=1).cpu())
    return torch.stack(out)


def _decode_side(conn, device: int) -> None:
    import torch

    from pdkv.transport.cuda_ipc import CudaIpcTransport

    with CudaIpcTransport(device) as t:
        kv = [torch.zeros(D_BLOCKS * BLOCK_LEN, dtype=torch.uint8, device=f"cuda:{device}") for _ in range(LAYERS)]
        t.register([(x.data_ptr(), x.numel()) for x in kv])
        conn.send((t.hello(), [x.data_ptr() for x in kv], t.session_address))
        while (msg := conn.recv()) != "stop":
            torch.cuda.synchronize(device)
            conn.send(_digests(kv, torch.tensor(msg, device=f"cuda:{device}")))


def _prefill_side(t, device: int, gen):
    """P's KV: LAYERS random layers on `device`, registered with transport `t`; (tensors, their regions)."""
    import torch

    from pdkv.wire import Region

    src = [torch.randint(0, 256, (P_BLOCKS * BLOCK_LEN,), dtype=torch.uint8, generator=gen).to(f"cuda:{device}")
           for _ in range(LAYERS)]
    t.register([(x.data_ptr(), x.numel()) for x in src])
    torch.cuda.synchronize(device)
    return src, [Region(x.data_ptr(), BLOCK_LEN, P_BLOCKS) for x in src]


def test_32_concurrent_transfers_each_land_in_their_own_blocks():
    import torch

    from pdkv.wire import Region
    from pdkv.transport.cuda_ipc import CudaIpcTransport

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    p_dev, d_dev = (0, 1) if torch.cuda.device_count() > 1 else (0, 0)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child, d_dev), daemon=True)
    proc.start()
    try:
        assert parent.poll(180), "decode side did not export in time"
        hello, remote_bases, _ = parent.recv()
        remote = [Region(b, BLOCK_LEN, D_BLOCKS) for b in remote_bases]
        gen = torch.Generator().manual_seed(0)
        with CudaIpcTransport(p_dev) as t:
            src, local = _prefill_side(t, p_dev, gen)
            plans = []
            for i in range(REQUESTS):
                lblocks = torch.randperm(P_BLOCKS, generator=gen)[:PER_REQUEST].tolist()  # sources overlap across requests
                rblocks = (i * PER_REQUEST + torch.randperm(PER_REQUEST, generator=gen)).tolist()
                plans.append((lblocks, rblocks))
            start = threading.Barrier(REQUESTS)

            def send(plan):
                start.wait(30)
                t.connect("d", hello)  # every thread, as the sender's transfer threads do: opened once
                return t.write_blocks("d", plan[0], plan[1], local, remote)

            with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
                written = list(pool.map(send, plans, timeout=300))
            assert [w.bytes for w in written] == [LAYERS * PER_REQUEST * BLOCK_LEN] * REQUESTS
            torch.cuda.synchronize(p_dev)
            lblocks = [b for lb, _ in plans for b in lb]
            rblocks = [b for _, rb in plans for b in rb]
            want = _digests(src, torch.tensor(lblocks, device=f"cuda:{p_dev}"))
        parent.send(rblocks)
        assert parent.poll(120)
        got = parent.recv()
        assert torch.equal(got, want), f"{int((got != want).any(dim=2).sum())} of {got.shape[0] * got.shape[1]} blocks differ"
    finally:
        if proc.is_alive():
            parent.send("stop")
        proc.join(30)


def _start_decode(ctx, device: int):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child, device), daemon=True)
    proc.start()
    return proc, parent


def _wait(what: str, done, bound_s: float) -> None:
    t0 = time.monotonic()
    while not done():
        assert time.monotonic() - t0 < bound_s, f"{what} did not happen within {bound_s} s"
        time.sleep(0.002)


def test_a_decode_killed_mid_run_fails_its_writes_at_once_and_the_other_decode_is_served():
    import torch

    from pdkv.errors import TransferError
    from pdkv.wire import Region
    from pdkv.transport.cuda_ipc import CudaIpcTransport

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    p_dev, d_dev = (0, 1) if torch.cuda.device_count() > 1 else (0, 0)
    ctx = mp.get_context("spawn")
    (proc1, conn1), (proc2, conn2) = _start_decode(ctx, d_dev), _start_decode(ctx, d_dev)
    stop = threading.Event()
    try:
        assert conn1.poll(180) and conn2.poll(180), "decode sides did not export in time"
        (hello1, bases1, s1), (hello2, bases2, s2) = conn1.recv(), conn2.recv()
        remote = {s1: [Region(b, BLOCK_LEN, D_BLOCKS) for b in bases1], s2: [Region(b, BLOCK_LEN, D_BLOCKS) for b in bases2]}
        gen = torch.Generator().manual_seed(1)
        with CudaIpcTransport(p_dev) as t:
            src, local = _prefill_side(t, p_dev, gen)
            t.connect(s1, hello1)
            t.connect(s2, hello2)
            assert sorted(t.peers) == sorted([s1, s2])
            half = REQUESTS // 2  # threads 0..15 write to D1, 16..31 to D2, each into blocks of its own
            plans = [(torch.randperm(P_BLOCKS, generator=gen)[:PER_REQUEST].tolist(),
                      ((i % half) * PER_REQUEST + torch.randperm(PER_REQUEST, generator=gen)).tolist()) for i in range(REQUESTS)]
            writes = [0] * REQUESTS  # each slot written by its own thread only
            failed: dict[int, tuple[float, TransferError]] = {}

            def send(i: int) -> None:
                peer = s1 if i < half else s2
                while not stop.is_set():
                    try:
                        t.write_blocks(peer, plans[i][0], plans[i][1], local, remote[peer])
                    except TransferError as exc:
                        failed[i] = (time.monotonic(), exc)
                        return
                    writes[i] += 1

            with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
                futures = [pool.submit(send, i) for i in range(REQUESTS)]
                _wait("two writes from every thread", lambda: min(writes) >= 2, 120)
                os.kill(proc1.pid, signal.SIGKILL)
                killed = time.monotonic()
                _wait("a failed write from every thread writing to the killed D", lambda: len(failed) == half, 30)
                after = writes[half:]
                _wait("three more writes to the live D from each of its threads",
                      lambda: all(w - a >= 3 for w, a in zip(writes[half:], after, strict=True)), 60)
                stop.set()
                for f in futures:
                    f.result(timeout=60)
            proc1.join(30)
            assert sorted(failed) == list(range(half)), f"threads writing to the live D failed: {sorted(set(failed) - set(range(half)))}"
            for at, exc in failed.values():
                assert f"decode process {proc1.pid} ({s1}) exited" in exc.message, exc.message
            assert max(at for at, _ in failed.values()) - killed < 2.0, "writes to the dead D did not fail at once"
            assert t.peers == [s2], "the dead D's handles are still open"
            started = time.monotonic()
            with pytest.raises(TransferError, match=r"exited"):
                t.write_blocks(s1, plans[0][0], plans[0][1], local, remote[s1])
            assert time.monotonic() - started < 1.0
            with pytest.raises(TransferError, match=r"does not exist|exited"):
                t.connect(s1, hello1)
            torch.cuda.synchronize(p_dev)
            lblocks = [b for lb, _ in plans[half:] for b in lb]
            rblocks = [b for _, rb in plans[half:] for b in rb]
            want = _digests(src, torch.tensor(lblocks, device=f"cuda:{p_dev}"))
        conn2.send(rblocks)
        assert conn2.poll(120)
        got = conn2.recv()
        assert torch.equal(got, want), f"{int((got != want).any(dim=2).sum())} of {got.shape[0] * got.shape[1]} blocks of the live D differ"
    finally:
        stop.set()
        for proc, conn in ((proc1, conn1), (proc2, conn2)):
            if proc.is_alive():
                conn.send("stop")
            proc.join(30)


def _capture_while_computing(conn) -> None:
    import torch

    from pdkv.transport.cuda_ipc import CudaIpcTransport

    errors: list[str] = []
    stop = threading.Event()

    def model() -> None:
        a = torch.randn(2048, 2048, device="cuda:0", dtype=torch.bfloat16)
        try:
            while not stop.is_set():
                (a @ a).sum().item()
        except BaseException as e:  # the failure this test looks for
            errors.append(repr(e))

    most = 256
    src = torch.randint(0, 256, (LAYERS, most, BLOCK_LEN), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src)
    bases = [x.data_ptr() for x in src] + [x.data_ptr() for x in dst]
    with CudaIpcTransport(0) as t:
        worker = threading.Thread(target=model)
        worker.start()
        try:
            for nb in (16, 32, 64, 128, most):
                graph = t._block_graph(0, LAYERS, nb, BLOCK_LEN)
                # The table a write fills before each replay: every layer's base on both sides, then block ids (a
                # graph replayed on its zeroed table would copy from address 0).
                graph.host.numpy()[:] = bases + list(range(nb)) + list(range(nb))
                graph.graph.replay()
            torch.cuda.synchronize(0)
        finally:
            stop.set()
            worker.join(30)
        if not errors and not torch.equal(src, dst):
            errors.append("the replayed graphs did not copy every block")
        conn.send(errors)
    conn.send("closed")


def test_graphs_captured_while_another_thread_computes_leave_that_thread_working():
    """The engine's model runs in one thread while the sender captures a write's CUDA graph in another: a capture in
    torch's default ("global") mode made the model's next matmul fail (operation not permitted when stream is
    capturing) and killed P. The graphs then copy every block they were given. In a child process, so that a crash
    (at the graphs' release, say) is a failure here."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_capture_while_computing, args=(child,))
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not parent.poll(0.5):  # a crash (a CUDA error aborts the process) fails the test at once
            assert proc.is_alive() or parent.poll(0), f"the capturing process died (exit code {proc.exitcode}) before answering"
            assert time.monotonic() < deadline, "no word from the capturing process within 120 s"
        errors = parent.recv()
        assert not errors, f"during the captures: {errors[0]}"
        assert parent.poll(60) and parent.recv() == "closed", "the transport did not close"
        proc.join(30)
        assert proc.exitcode == 0, f"the capturing process ended with {proc.exitcode} after closing its transport"
    finally:
        if proc.is_alive():
            proc.kill()

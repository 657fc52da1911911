"""CUDA IPC under concurrent transfers: 32 requests from 32 threads, the seed's Qwen3-8B geometry (36 layers,
64 KiB per layer per block, 63 blocks each), every destination block checked against its source.

D's memory is GPU 1's where two GPUs are visible, else GPU 0's in another process (CUDA IPC still crosses the
process boundary). Marker `gpu`: skipped where no GPU exists.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import threading

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
        conn.send((t.hello(), [x.data_ptr() for x in kv]))
        while (msg := conn.recv()) != "stop":
            torch.cuda.synchronize(device)
            conn.send(_digests(kv, torch.tensor(msg, device=f"cuda:{device}")))


def test_32_concurrent_transfers_each_land_in_their_own_blocks():
    import torch

    from pdkv.transport.base import Region
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
        hello, remote_bases = parent.recv()
        remote = [Region(b, BLOCK_LEN, D_BLOCKS) for b in remote_bases]
        gen = torch.Generator().manual_seed(0)
        with CudaIpcTransport(p_dev) as t:
            src = [torch.randint(0, 256, (P_BLOCKS * BLOCK_LEN,), dtype=torch.uint8, generator=gen).to(f"cuda:{p_dev}")
                   for _ in range(LAYERS)]
            t.register([(x.data_ptr(), x.numel()) for x in src])
            local = [Region(x.data_ptr(), BLOCK_LEN, P_BLOCKS) for x in src]
            torch.cuda.synchronize(p_dev)
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

"""CUDA IPC transport vs plain peer copies, Qwen3-8B geometry, one host with two GPUs.

    python benchmarks/ipc_gpu.py [--blocks 63] [--iters 50] [--json OUT]

D's KV (36 layers x 512 blocks x 64 KiB) lives in a second process on cuda:1
and is opened in P through CUDA IPC; each layout is written by pdkv's
CudaIpcTransport and, in the same run, by plain `copy_` calls in one process
(one call per descriptor) for comparison. Bytes are verified every layout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import time

LAYERS, NUM_BLOCKS, BLOCK_LEN = 36, 512, 64 * 1024


def layout_blocks(layout: str, n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    if layout in ("contiguous", "per-block"):
        return list(range(n)), list(range(100, 100 + n))
    rng = random.Random(seed)
    return sorted(rng.sample(range(0, NUM_BLOCKS, 2), n)), rng.sample(range(1, NUM_BLOCKS, 2), n)


def decode_side(conn, device: int) -> None:
    import torch

    from pdkv.transport.cuda_ipc import CudaIpcTransport

    with CudaIpcTransport(device) as t:
        kv = [torch.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=torch.uint8, device=f"cuda:{device}") for _ in range(LAYERS)]
        t.register([(x.data_ptr(), x.numel()) for x in kv])
        conn.send((t.export(), [x.data_ptr() for x in kv]))
        while (blocks := conn.recv()) != "stop":
            torch.cuda.synchronize(device)
            conn.send([int(x.view(NUM_BLOCKS, BLOCK_LEN)[blocks].to(torch.int64).sum()) for x in kv])
            for x in kv:
                x.zero_()
            torch.cuda.synchronize(device)
            conn.send("clean")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=63)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    from pdkv.transport import ipc_reachable, plan_descriptors
    from pdkv.transport.cuda_ipc import CudaIpcTransport
    from pdkv.wire import Region

    print("reachable:", ipc_reachable(0, 1))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_side, args=(child, 1), daemon=True)
    proc.start()
    export, remote_bases = parent.recv()
    rows = []
    with CudaIpcTransport(0) as t:
        g = torch.Generator(device="cuda:0").manual_seed(0)
        src = [torch.randint(0, 256, (NUM_BLOCKS * BLOCK_LEN,), dtype=torch.uint8, device="cuda:0", generator=g) for _ in range(LAYERS)]
        t.register([(x.data_ptr(), x.numel()) for x in src])
        t.connect("d", export)
        local = [Region(x.data_ptr(), BLOCK_LEN, NUM_BLOCKS) for x in src]
        remote = [Region(b, BLOCK_LEN, NUM_BLOCKS) for b in remote_bases]
        # Same-process baseline target on cuda:1.
        dst_local = [torch.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=torch.uint8, device="cuda:1") for _ in range(LAYERS)]
        for layout in ("contiguous", "per-block", "scattered"):
            lb, rb = layout_blocks(layout, args.blocks)
            descs = plan_descriptors(lb, rb, local, remote, coalesce=layout != "per-block")
            nbytes = sum(d.length for d in descs)
            t0 = time.perf_counter()
            t.write_blocks("d", lb, rb, local, remote)
            cold = (time.perf_counter() - t0) * 1e3
            parent.send(rb)
            got = parent.recv()
            assert parent.recv() == "clean"
            want = [int(x.view(NUM_BLOCKS, BLOCK_LEN)[lb].to(torch.int64).sum()) for x in src]
            verified = got == want
            times, dtimes = [], []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                t.write_blocks("d", lb, rb, local, remote)
                times.append((time.perf_counter() - t0) * 1e3)
            for _ in range(args.iters):
                t0 = time.perf_counter()
                t.write("d", descs)
                dtimes.append((time.perf_counter() - t0) * 1e3)
            t.profile = True
            kb, kd = [], []
            for _ in range(20):
                t.write_blocks("d", lb, rb, local, remote)
                kb.append(t.last_kernel_ms)
                t.write("d", descs)
                kd.append(t.last_kernel_ms)
            t.profile = False
            # Plain copy_: one call per descriptor, same process, cuda:0 -> cuda:1.
            pairs = []
            for d in descs:
                li = next(i for i, r in enumerate(local) if r.base <= d.src < r.base + r.size)
                ri = next(i for i, r in enumerate(remote) if r.base <= d.dst < r.base + r.size)
                so, do = d.src - local[li].base, d.dst - remote[ri].base
                pairs.append((dst_local[ri][do : do + d.length], src[li][so : so + d.length]))
            ctimes = []
            for _ in range(args.iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for dv, sv in pairs:
                    dv.copy_(sv, non_blocking=True)
                torch.cuda.synchronize()
                ctimes.append((time.perf_counter() - t0) * 1e3)
            row = {
                "layout": layout, "bytes": nbytes, "descriptors": len(descs), "verified": verified, "cold_ms": cold,
                "ipc_p50_ms": statistics.median(times), "ipc_p99_ms": pct(times, 99), "ipc_min_ms": min(times),
                "ipc_gbps_p50": nbytes / statistics.median(times) / 1e6,
                "descriptor_write_p50_ms": statistics.median(dtimes),
                "block_kernel_p50_ms": statistics.median(kb), "chunk_kernel_p50_ms": statistics.median(kd),
                "copy_p50_ms": statistics.median(ctimes), "copy_over_ipc": statistics.median(ctimes) / statistics.median(times),
            }
            rows.append(row)
            print(json.dumps(row))
    parent.send("stop")
    proc.join(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

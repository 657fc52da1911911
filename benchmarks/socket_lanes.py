"""The socket transport's connections and socket buffers, swept: one 141.75 MiB write (the seed's 63 blocks of
Qwen3-8B as 36 layer-sized descriptors) from this process into a second one over 127.0.0.1, bytes not verified
(`pdkv bench --transport socket` verifies them), p50 of 12 writes after 2 warm-up writes.

Run: python benchmarks/socket_lanes.py [--buffers 0,131072,262144,524288,1048576] [--connections 1,2,4,8]
(0: the kernel's autotuned socket buffers). docs/socket.md and docs/bench.md quote it.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv.transport import Descriptor  # noqa: E402
from pdkv.transport.sockets import SocketTransport  # noqa: E402

NBYTES = 148_635_648
LAYERS = 36


def _decode(queue, stop, buffer_bytes: int) -> None:
    dst = (ctypes.c_char * NBYTES)()
    base = ctypes.addressof(dst)
    with SocketTransport(buffer_bytes=buffer_bytes) as d:
        d.register([(base, NBYTES)])
        d.expect("sweep", [(base, NBYTES)])
        queue.put((d.session_address, base))
        stop.wait(600)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buffers", default="0,131072,262144,524288,1048576")
    ap.add_argument("--connections", default="1,2,4,8")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    src = (ctypes.c_char * NBYTES)()
    a = ctypes.addressof(src)
    step = NBYTES // LAYERS
    print(f"{'buffer':>10} {'connections':>11} {'p50 ms':>8} {'GB/s':>6} {'min ms':>7}")
    for buf in map(int, args.buffers.split(",")):
        queue, stop = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_decode, args=(queue, stop, buf), daemon=True)
        proc.start()
        session, b = queue.get(timeout=60)
        for n in map(int, args.connections.split(",")):
            with SocketTransport(writable=False, connections=n, buffer_bytes=buf) as p:
                p.register([(a, NBYTES)])
                descriptors = [Descriptor(a + i * step, b + i * step, step) for i in range(LAYERS)]
                times = []
                for _ in range(14):
                    t0 = time.perf_counter()
                    p.write(session, descriptors, transfer="sweep")
                    times.append(time.perf_counter() - t0)
            times = sorted(times[2:])
            p50 = times[len(times) // 2]
            label = "autotuned" if buf == 0 else f"{buf >> 10} KiB"
            print(f"{label:>10} {n:>11} {p50 * 1e3:8.1f} {NBYTES / p50 / 1e9:6.2f} {times[0] * 1e3:7.1f}", flush=True)
        stop.set()
        proc.join(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

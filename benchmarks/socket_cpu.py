"""The socket transport's wall time and CPU time per write, P's and D's processes apart: the seed's 63 blocks of Qwen3-8B
(141.75 MiB as 36 layer regions), contiguous or scattered as `pdkv bench` lays them out, from a P process into a D
process over 127.0.0.1 or (`--netns`, root) between two network-namespace hosts (tests/multihost/netns.py).

On a shared 2-core machine wall times swing with whatever else runs; the CPU each side spends per write (getrusage of
the process, all its threads, over the timed writes) swings far less, and `others` (the machine's busy time not
spent by P or D, in % of both cores) says whether anything else ran. Bytes are not verified (`pdkv bench` does).
Each round runs every (socket buffer, layout) once, with new processes and, with --netns, new namespaces.
`--pin same` puts each connection's sending thread (P) and receiving thread (D) on one core, connection i on core
i mod 2; `--pin split` puts them on different cores: the two arrangements the kernel settles into when P and D
share 2 cores, one of which writes up to twice as slow.

Run: python benchmarks/socket_cpu.py [--netns] [--buffers 98304,262144] [--connections 2] [--layouts contiguous,scattered]
     [--pin same|split]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

LAYERS, BLOCK_BYTES, BLOCKS = 36, 64 << 10, 63
TRANSFER = "socket-cpu"


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _switches() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw


def _busy_s() -> float:
    """Seconds both cores spent outside idle and iowait since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _regions(num_blocks: int, fill: bool):
    import numpy as np

    rng = np.random.default_rng(0)
    size = BLOCK_BYTES * num_blocks
    return [rng.integers(0, 255, size, dtype=np.uint8) if fill else np.zeros(size, np.uint8) for _ in range(LAYERS)]


def _pin(thread_id: int, core: int) -> None:
    os.sched_setaffinity(thread_id, {core % (os.cpu_count() or 1)})


def decode_main(host: str, buffer_bytes: int, num_blocks: int, pin: str) -> None:
    """D: registers and grants its regions, prints its session, then answers `mark` (with P's lanes by local port,
    for `pin`) and `stop` on stdin (its CPU time and context switches between the two)."""
    import threading

    from pdkv.transport.sockets import SocketTransport

    bufs = _regions(num_blocks, fill=False)
    spans = [(int(b.ctypes.data), b.nbytes) for b in bufs]
    with SocketTransport(host, buffer_bytes=buffer_bytes) as d:
        d.register(spans)
        d.expect(TRANSFER, spans)
        print(json.dumps({"session": d.session_address, "bases": [a for a, _ in spans]}), flush=True)
        cpu0 = sw0 = 0.0
        for line in sys.stdin:
            if line.startswith("mark"):
                lanes = json.loads(line[4:])
                for t in threading.enumerate():  # a connection's thread is named after P's address and port
                    port = t.name.rsplit(":", 1)[-1]
                    if pin != "none" and t.name.startswith("pdkv-socket-conn") and port in lanes and t.native_id:
                        _pin(t.native_id, lanes[port] + (pin == "split"))
                cpu0, sw0 = _cpu_s(), _switches()
                print("ok", flush=True)
            elif line.startswith("stop"):
                print(json.dumps({"cpu_s": _cpu_s() - cpu0, "switches": _switches() - sw0}), flush=True)
                return


def prefill_main(args: argparse.Namespace) -> None:
    """P: starts D (`args.d_prefix` runs it in D's namespace), writes the layout's blocks 3 times cold, then times
    `args.iters` writes; prints one JSON line."""
    from pdkv.bench.layout import block_ids, blocks_needed
    from pdkv.transport.base import Region
    from pdkv.transport.sockets import SocketTransport

    num_blocks = blocks_needed("scattered", BLOCKS)
    argv = [*args.d_prefix.split(), sys.executable, __file__, "--role", "d", "--host", args.host, "--buffer", str(args.buffer),
            "--num-blocks", str(num_blocks), "--pin", args.pin]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as d:
        assert d.stdin is not None and d.stdout is not None
        ready = json.loads(d.stdout.readline())
        bufs = _regions(num_blocks, fill=True)
        local = [Region(int(b.ctypes.data), BLOCK_BYTES, num_blocks) for b in bufs]
        remote = [Region(a, BLOCK_BYTES, num_blocks) for a in ready["bases"]]
        src, dst = block_ids(args.layout, BLOCKS)
        with SocketTransport(writable=False, connections=args.connections, buffer_bytes=args.buffer) as p:
            p.register([(r.base, BLOCK_BYTES * num_blocks) for r in local])

            def write() -> None:
                p.write_blocks(ready["session"], src, dst, local, remote, transfer=TRANSFER)

            for _ in range(3):
                write()
            lanes = next(iter(p._peers.values())).lanes  # a diagnostic reaches into the transport: not for callers
            if args.pin != "none":
                for i, lane in enumerate(lanes):
                    assert lane._thread.native_id is not None
                    _pin(lane._thread.native_id, i)
            ports = {str(lane._sock.getsockname()[1]): i for i, lane in enumerate(lanes) if lane._sock is not None}
            d.stdin.write(f"mark{json.dumps(ports)}\n")
            d.stdin.flush()
            d.stdout.readline()
            cpu0, sw0, busy0, t0 = _cpu_s(), _switches(), _busy_s(), time.perf_counter()
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                write()
                times.append((time.perf_counter() - start) * 1e3)
            cpu, sw, busy, wall = _cpu_s() - cpu0, _switches() - sw0, _busy_s() - busy0, time.perf_counter() - t0
            d.stdin.write("stop\n")
            d.stdin.flush()
            theirs = json.loads(d.stdout.readline())
    times.sort()
    n = args.iters
    print(json.dumps({
        "p50_ms": times[n // 2], "min_ms": times[0], "p_cpu_ms": cpu / n * 1e3, "d_cpu_ms": theirs["cpu_s"] / n * 1e3,
        "p_switches": sw / n, "d_switches": theirs["switches"] / n,
        "others_pct": 100 * (busy - cpu - theirs["cpu_s"]) / wall / (os.cpu_count() or 1),
    }), flush=True)


def run_case(args: argparse.Namespace, buffer_bytes: int, layout: str, hosts) -> dict:
    common = ["--layout", layout, "--buffer", str(buffer_bytes), "--connections", str(args.connections), "--iters", str(args.iters),
              "--pin", args.pin]
    env = f"PYTHONPATH={ROOT}"
    if hosts is None:
        argv = [sys.executable, __file__, "--role", "p", "--host", "127.0.0.1", *common]
    else:
        p, d = hosts
        argv = p.argv("env", env, sys.executable, __file__, "--role", "p", "--host", d.address,
                      "--d-prefix", " ".join(d.argv("env", env)), *common)
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        sys.exit(f"socket_cpu: a case failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--netns", action="store_true", help="P and D in two network namespaces (root), not over 127.0.0.1")
    ap.add_argument("--buffers", default="98304,131072,262144", help="socket buffer sizes (SO_SNDBUF/SO_RCVBUF; the kernel doubles them)")
    ap.add_argument("--connections", type=int, default=0, help="connections per write (0: the transport's default)")
    ap.add_argument("--layouts", default="contiguous,scattered")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pin", choices=("none", "same", "split"), default="none",
                    help="each connection's two ends on one core (same) or on two (split); default: where the kernel puts them")
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--d-prefix", default="", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="contiguous", help=argparse.SUPPRESS)
    ap.add_argument("--buffer", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "d":
        decode_main(args.host, args.buffer, args.num_blocks, args.pin)
        return 0
    if args.role == "p":
        prefill_main(args)
        return 0
    if args.netns:
        from multihost.netns import unavailable

        if why := unavailable():
            sys.exit(f"socket_cpu: {why}")
    print(f"{'round':>5} {'buffer':>8} {'layout':>10} {'p50 ms':>7} {'min ms':>7} {'P cpu ms':>8} {'D cpu ms':>8} "
          f"{'P sw':>5} {'D sw':>5} {'others':>6}", flush=True)
    for r in range(1, args.rounds + 1):
        for buffer_bytes in map(int, args.buffers.split(",")):
            for layout in args.layouts.split(","):
                if args.netns:
                    from multihost.netns import TestBed

                    with TestBed(["P", "D"]) as hosts:
                        c = run_case(args, buffer_bytes, layout, hosts)
                else:
                    c = run_case(args, buffer_bytes, layout, None)
                print(f"{r:>5} {buffer_bytes >> 10:>7}K {layout:>10} {c['p50_ms']:7.1f} {c['min_ms']:7.1f} {c['p_cpu_ms']:8.1f} "
                      f"{c['d_cpu_ms']:8.1f} {c['p_switches']:5.0f} {c['d_switches']:5.0f} {c['others_pct']:5.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

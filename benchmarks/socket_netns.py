"""`pdkv bench --transport socket --baseline` between two network-namespace "hosts" (tests/multihost/netns.py): D's
side (`pdkv bench serve`) in one namespace, P's (`pdkv bench run --target`) in the other, over a veth pair and a
bridge; optionally with the link shaped by `tc` (a token bucket on both hosts' eth0) to a line rate, to see what share
of it the write reaches. Needs root and iproute2; the namespaces are removed afterwards.

Run: python benchmarks/socket_netns.py [--rate 10gbit] [--iters 20] [--layout contiguous] [--socket-buffer BYTES] [--connections N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from multihost.netns import TestBed, unavailable  # noqa: E402

PORT = 18600


def shape(host, rate: str) -> None:
    # A token bucket: at most `rate` leaves eth0; the burst holds a few ms of it, the queue 20 ms.
    subprocess.run(host.argv("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "4mb", "latency", "20ms"),
                   check=True, timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="", help="shape both hosts' links to this tc rate (e.g. 10gbit); default: unshaped")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layout", default="contiguous")
    ap.add_argument("--model", default=str(ROOT / "tests/fixtures/configs/qwen3-8b"))
    ap.add_argument("--socket-buffer", type=int, default=None,
                    help="each connection's socket buffers, both hosts (pdkv bench --socket-buffer)")
    ap.add_argument("--connections", type=int, default=0, help="P's connections to D (pdkv bench --connections; 0: the default)")
    args = ap.parse_args()
    if why := unavailable():
        sys.exit(f"socket_netns: {why}")
    env_path = f"PYTHONPATH={ROOT}"
    sized = ["--socket-buffer", str(args.socket_buffer)] if args.socket_buffer is not None else []
    with TestBed(["P", "D"]) as (p, d):
        if args.rate:
            shape(p, args.rate)
            shape(d, args.rate)
        serve = subprocess.Popen(d.argv("env", env_path, sys.executable, "-m", "pdkv", "bench", "serve", "--host", d.address,
                                        "--port", str(PORT), "--transport", "socket", "--once", "--json", *sized),
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert serve.stdout is not None
            text = ""
            while True:  # printed (indented JSON) once the target listens
                line = serve.stdout.readline()
                if not line:
                    sys.exit("pdkv bench serve ended before it listened")
                text += line
                if line.startswith("}"):
                    break
            ready = json.loads(text)
            run = subprocess.run(p.argv("env", env_path, sys.executable, "-m", "pdkv", "bench", "run", "--target", ready["address"],
                                        "--model", args.model, "--blocks", "63", "--transport", "socket", "--layout", args.layout,
                                        "--baseline", "--iters", str(args.iters), "--connections", str(args.connections), "--json", *sized),
                                 capture_output=True, text=True, timeout=900)
            if run.returncode != 0:
                sys.exit(f"pdkv bench run failed: {run.stderr[-2000:]}")
            report = json.loads(run.stdout)
        finally:
            try:
                serve.wait(30)
            except subprocess.TimeoutExpired:
                serve.kill()
    line = f" of {args.rate}" if args.rate else ""
    for c in report["cases"]:
        t, b = c["timing"], c["baseline"]["bare"]
        gbit = c["bytes"] * 8 / (t["p50_ms"] / 1e3) / 1e9
        share = ""
        if args.rate.endswith("gbit"):
            share = f", {100 * gbit / float(args.rate[:-4]):.1f}% of the line rate"
        print(f"{c['layout']}, {c['bytes']:,} B, P {p.address} -> D {d.address}{line}: socket p50 {t['p50_ms']:.1f} ms "
              f"({gbit:.2f} Gb/s{share}); Mooncake tcp p50 {b['p50_ms']:.1f} ms; socket/Mooncake throughput "
              f"{b['p50_ms'] / t['p50_ms']:.2f}x; verified {c['verified']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What `pdkv top` polling costs pdkv's proxy: requests/s at one concurrency with and without it, rounds alternated.

The proxy and its stubs as in run.py (P answers after 5 ms; D streams 8 SSE chunks 1 ms apart). In each "on"
round a real `pdkv top --proxy URL --interval 1` runs beside the load (its screen to /dev/null): every second
it reads the proxy's /health and /metrics and each stub's /metrics. Rounds alternate off, on, off, on, ...
so a drift of the machine falls on both sides. Prints each round, the medians and the ratio on/off.

Run: python benchmarks/proxy/top_cost.py [--rounds 4] [--duration 5] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from run import HERE, PDKV_LAUNCH, PY, free_port, start, stop, wait_ready


def load(url: str, concurrency: int, duration: float, warmup: float) -> dict:
    out = subprocess.run([PY, str(HERE / "loadgen.py"), "--url", url, "--concurrency", str(concurrency), "--duration", str(duration),
                          "--warmup", str(warmup)], capture_output=True, text=True, timeout=duration + warmup + 60,
                         check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each kind (off and on)")
    ap.add_argument("--duration", type=float, default=5.0, help="measured seconds per round")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--logs", default="/tmp/pdkv-proxy-bench", help="directory for the processes' logs")
    args = ap.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    ports = {k: free_port() for k in ("p", "d", "b", "proxy")}
    p_url, d_url, b_url = (f"http://127.0.0.1:{ports[k]}" for k in ("p", "d", "b"))
    url = f"http://127.0.0.1:{ports['proxy']}"
    stubs = start([PY, str(HERE / "stubs.py"), "--p-port", str(ports["p"]), "--d-port", str(ports["d"]),
                   "--bootstrap-port", str(ports["b"])], logs / "stubs-top.log")  # fmt: skip
    proxy = start([PY, "-c", PDKV_LAUNCH, f"{p_url},{b_url}", d_url, str(ports["proxy"])], logs / "pdkv-top.log")
    rps: dict[str, list[float]] = {"off": [], "on": []}
    try:
        wait_ready(url)
        for i in range(2 * args.rounds):
            kind = "on" if i % 2 else "off"
            top = None
            if kind == "on":
                top = subprocess.Popen([PY, "-m", "pdkv", "top", "--proxy", url, "--interval", "1"], stdout=subprocess.DEVNULL,
                                       stderr=(logs / "top.log").open("w"))  # fmt: skip
            try:
                result = load(url, args.concurrency, args.duration, args.warmup)
            finally:
                if top is not None:
                    top.terminate()
                    top.wait(10)
            rps[kind].append(result["rps"])
            print(f"round {i + 1} top {kind:3}: {result['rps']:.0f} req/s, TTFB p50 {result['ttfb_p50_ms']:.2f} ms, "
                  f"errors {result['errors']}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        stop(proxy)
        stop(stubs)
    off, on = statistics.median(rps["off"]), statistics.median(rps["on"])
    spread = (max(rps["off"]) - min(rps["off"])) / off
    print(f"concurrency {args.concurrency}: median req/s without pdkv top {off:.0f}, with it {on:.0f}: ratio {on / off:.3f} "
          f"(rounds without it spread {spread * 100:.1f}%)")  # fmt: skip


if __name__ == "__main__":
    main()

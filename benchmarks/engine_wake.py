"""A prompt's time on an engine against how long the engine was idle before it.

Sends one-token requests of --prompt-tokens random token ids one at a time,
each --gap ms after the previous answer, for each gap named, and prints per
gap the median latency at the client and P's own time a request (queue and
prefill, the growth of its /metrics), with the GPU's SM clock and power as
nvidia-smi reads them after the gap's requests (where there is one). A
profile times prompts sent back to back; under Poisson arrivals at light
load most prompts find the engine idle for tens of ms.

    python benchmarks/engine_wake.py --url http://127.0.0.1:8100 --gaps 0,25,100,400 --count 15
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import subprocess
import sys
import time

import httpx

from pdkv.planner.measure import TOKEN_IDS, engine_model, scrape
from pdkv.planner.profile import median


def _gpu() -> str:
    if not shutil.which("nvidia-smi"):
        return "-"
    q = "--query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu"
    out = subprocess.run(["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout
    return out.splitlines()[0].strip() if out else "-"


async def run(url: str, gaps: list[float], count: int, tokens: int, rounds: int, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await engine_model(client, url))[0]
        print(f"{url} ({model}): {count} prompts of {tokens} tokens a gap, one at a time; {rounds} round(s)")
        print("round  gap ms  latency p50 ms  P's own ms/request  GPU after (SM MHz, max, W, C)")
        for r in range(rounds):
            for gap in gaps:
                before = await scrape(client, url)
                latencies = []
                for _ in range(count):
                    await asyncio.sleep(gap / 1000)
                    body = {"model": model, "prompt": [rng.choice(TOKEN_IDS) for _ in range(tokens)], "max_tokens": 1, "temperature": 0}
                    t0 = time.perf_counter()
                    (await client.post(f"{url}/v1/completions", json=body)).raise_for_status()
                    latencies.append((time.perf_counter() - t0) * 1e3)
                await asyncio.sleep(0.2)
                after = await scrape(client, url)
                own_ms, answered, _ = after.since(before)
                own = f"{own_ms / answered:8.1f}" if answered > 0 else "       -"
                print(f"{r:5d} {gap:7.0f} {median(latencies):15.1f} {own:>19}  {_gpu()}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--gaps", default="0,10,25,50,100,200,400")
    ap.add_argument("--count", type=int, default=15)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    asyncio.run(run(args.url.rstrip("/"), [float(g) for g in args.gaps.split(",")], args.count, args.prompt_tokens, args.rounds,
                    args.seed))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

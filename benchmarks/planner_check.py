"""The planner's models against a real engine: predicted and measured TTFT of P at two loads.

Reads a profile (`pdkv profile -o FILE`) of the engine at --url, then for each
--utilization u sends one-token requests of --prompt-tokens random token ids
to the engine as a Poisson stream at the rate that keeps P's engine busy a
share u of the time by the profile (rate = u / S(L), S the engine's time for a
prompt alone, without the request's time outside the engine), for --seconds, and measures each
request's TTFT at the client. Beside each measurement: the simulator's TTFT
for the same rate and length (pdkv.planner.simulate, one P, no D: decode and
handover taken out of the profile, as this is P alone), and the analytic
G/G/1 prediction (pdkv.planner.capacity). One engine, one role: what a
2-core host can run beside the client.

    python benchmarks/planner_check.py --url http://127.0.0.1:8100 --profile tiny.profile.json
    python benchmarks/planner_check.py --url ... --profile ... --utilization 0.3,0.7 --seconds 60 --json

Exit status 1 when a simulated p50 or p90 is off the measured one by more than --tolerance (default 0.2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

import httpx
import msgspec

from pdkv.planner.capacity import predict_prefill
from pdkv.planner.fit import DecodeFit
from pdkv.planner.measure import TOKEN_IDS, engine_model, scrape
from pdkv.planner.profile import load_profile
from pdkv.planner.simulate import SimConfig, Simulation
from pdkv.planner.workload import Slo, Workload


class Row(msgspec.Struct):
    utilization: float
    rate: float
    requests: int
    measured_p50_ms: float
    measured_p90_ms: float
    simulated_p50_ms: float
    simulated_p90_ms: float
    analytic_p90_ms: float
    p50_error: float  # simulated / measured - 1
    p90_error: float
    load_average: float  # the host's 1-minute load average when the run ended: other work on the same cores skews both
    # Where the measured time went, by P's own /metrics over the run (None where it did not say): its queue and
    # prefill time a request (mean), and the prompts a forward answered (requests over forwards); the simulator's same
    engine_ms: float | None = None
    per_forward: float | None = None
    simulated_engine_ms: float = 0.0
    simulated_per_forward: float = 0.0


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.999999) - 1))]


async def measure(url: str, model: str, rate: float, seconds: float, tokens: int,
                  seed: int) -> tuple[list[float], float | None, float | None]:
    """Each request's latency (ms), and P's own mean time a request and prompts a forward over the run (its /metrics)."""
    rng = random.Random(seed)
    latencies: list[float] = []

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        t0 = time.perf_counter()
        r = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        latencies.append((time.perf_counter() - t0) * 1e3)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=512)) as client:
        before = await scrape(client, url)
        tasks = []
        start = time.perf_counter()
        at = 0.0
        while True:
            at += rng.expovariate(rate)
            if at > seconds:
                break
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, [rng.choice(TOKEN_IDS) for _ in range(tokens)])))
        await asyncio.gather(*tasks)
        await asyncio.sleep(0.2)  # the engine records a request's times as its answer is made
        after = await scrape(client, url)
    own_ms, answered, forwards = after.since(before)
    engine_ms = own_ms / answered if answered > 0 else None
    return latencies, engine_ms, answered / forwards if forwards > 0 and answered > 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--utilization", default="0.3,0.7")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--tolerance", type=float, default=0.2)
    ap.add_argument("--max-batch-tokens", type=int, default=SimConfig(duration_s=0).max_batch_tokens,
                    help="the engine's --max-num-batched-tokens: the simulated P's tokens a forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    # P alone: nothing after P's answer.
    p_only = msgspec.structs.replace(profile, decode_fit=DecodeFit(0.0, 0.0, 0.0), handover_ms=0.0)
    service_s = profile.prefill_fit.prompt_ms(args.prompt_tokens) / 1000
    model = asyncio.run(_model(args.url))
    rows = []
    for i, u in enumerate(float(v) for v in args.utilization.split(",")):
        rate = u / service_s
        measured, engine_ms, per_forward = asyncio.run(measure(args.url, model, rate, args.seconds, args.prompt_tokens, args.seed + i))
        w = Workload(rate, [args.prompt_tokens], [1])
        slo = Slo(ttft_ms=1e9, itl_ms=1e9)
        # At least 5,000 simulated requests, so the simulated quantiles are the model's, not its sampling noise.
        config = SimConfig(duration_s=max(args.seconds, 5000 / rate), seed=args.seed, max_batch_tokens=args.max_batch_tokens)
        sim = Simulation(p_only, w, slo, lambda t, r=rate: r, rate, config, 1, 1)
        sim.run()
        ttft = [(f - a) * 1000 for a, f in zip(sim.arrival, sim.first, strict=True)]
        analytic = predict_prefill(p_only, w, 1, 0.9, 0.0).latency_ms
        m50, m90, s50, s90 = _q(measured, 0.5), _q(measured, 0.9), _q(ttft, 0.5), _q(ttft, 0.9)
        sim_engine = sum(ttft) / len(ttft) - profile.prefill_fit.outside_ms
        rows.append(Row(u, rate, len(measured), m50, m90, s50, s90, analytic, s50 / m50 - 1, s90 / m90 - 1, os.getloadavg()[0],
                        engine_ms, per_forward, sim_engine, sim.prefilled / max(1, sim.prefill_forwards)))  # fmt: skip
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(rows), indent=2).decode() + "\n")
    else:
        print(f"profile {args.profile}: {profile.model.name} on {profile.hardware.description}; prompts of {args.prompt_tokens} tokens, "
              f"S = {service_s * 1000:.1f} ms of P's engine alone, + {profile.prefill_fit.outside_ms:.1f} ms outside it")  # fmt: skip
        print("util  req/s  requests  measured p50/p90 ms  simulated p50/p90 ms  analytic p90 ms  error p50/p90  load"
              "  P's own ms/request, prompts/forward: measured | simulated")
        for r in rows:
            own = f"{r.engine_ms:6.1f} {r.per_forward:5.2f}" if r.engine_ms is not None and r.per_forward is not None else "     - -    "
            print(f"{r.utilization:4.2f} {r.rate:6.1f} {r.requests:9d}  {r.measured_p50_ms:8.1f} {r.measured_p90_ms:8.1f}   "
                  f"{r.simulated_p50_ms:8.1f} {r.simulated_p90_ms:8.1f}    {r.analytic_p90_ms:8.1f}     "
                  f"{r.p50_error:+.1%} {r.p90_error:+.1%}  {r.load_average:.1f}  {own} | "
                  f"{r.simulated_engine_ms:6.1f} {r.simulated_per_forward:5.2f}")  # fmt: skip
    return 0 if all(abs(r.p50_error) <= args.tolerance and abs(r.p90_error) <= args.tolerance for r in rows) else 1


async def _model(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        return (await engine_model(client, url))[0]


if __name__ == "__main__":
    sys.exit(main())

"""P/D TTFT and handover on one GPU host, side by side in one run: pdkv's connector over CUDA IPC, over its own TCP
(socket) or over Mooncake tcp against vLLM's MooncakeConnector over Mooncake tcp, each a running 1P1D of
tests/gpu/deployments.py (those its ACTIVE names; the MooncakeConnector's among them).

For each round, in an order that rotates, each deployment serves one fresh (uncached) prompt through pdkv's
proxy (P/D TTFT: P and D dispatched together, as users run it) and P alone serves another fresh prompt of the
same length (P's TTFT). The handover is the P/D TTFT minus P alone's: what disaggregation costs on that path.
Ratios against vLLM's MooncakeConnector are given per round (median) and of the medians. Then `pdkv trace` of
the seed's request (1,000-token prompt, 128 output tokens) on pdkv's deployments: the TTFT decomposition.

Run: python benchmarks/gpu_pd.py [--rounds 10] [--prompt-tokens 1000] [--json FILE]   (scripts/gpu/run.sh runs it)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gpu.deployments import ACTIVE, urls  # noqa: E402

SERVED = "qwen3-8b-random"
VOCAB = 151936
BASELINE = "mooncake-tcp"  # the ratios' default denominator: vLLM's own connector


def ttft_ms(url: str, ids: list[int], max_tokens: int) -> float:
    """Client TTFT of one streamed greedy completion: send to the first chunk that carries text."""
    body = {"model": SERVED, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120, trust_env=False) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:200]!r}")
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: no text in the stream")
    return (first - t0) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (one untimed warm-up round before)")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--traces", type=int, default=5, help="seed requests traced per pdkv deployment")
    ap.add_argument("--json", type=Path, help="write every sample and the summary here")
    ap.add_argument("--prompt-seed", type=int, default=None,
                    help="the prompts' random seed (default: a new one each run, so that engines kept up from an earlier "
                         "run hold none of them in their prefix caches)")
    ap.add_argument("--baseline", default=BASELINE,
                    help="the deployment the ratios are to (default: vLLM's MooncakeConnector's); e.g. pdkv-socket to "
                         "set pdkv-socket-layers beside it where both fit the GPU and the MooncakeConnector's does not")
    args = ap.parse_args()
    baseline = args.baseline
    if baseline not in ACTIVE:
        ap.error(f"the ratios are to {baseline}: name it in PDKV_GPU_DEPLOYMENTS (now {' '.join(ACTIVE)})")
    seed = args.prompt_seed if args.prompt_seed is not None else random.SystemRandom().randrange(1 << 62)
    rng = random.Random(seed)

    def fresh() -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(args.prompt_tokens)]

    samples: dict[str, dict[str, list[float]]] = {n: {"pd": [], "p_alone": []} for n in ACTIVE}
    for r in range(args.rounds + 1):
        order = ACTIVE[r % len(ACTIVE):] + ACTIVE[: r % len(ACTIVE)]
        for name in order:
            u = urls(name)
            pd, alone = ttft_ms(u.proxy, fresh(), args.max_tokens), ttft_ms(u.prefill, fresh(), args.max_tokens)
            if r > 0:
                samples[name]["pd"].append(pd)
                samples[name]["p_alone"].append(alone)
        print(f"round {r}/{args.rounds} done", file=sys.stderr)

    summary: dict[str, dict] = {}
    for name in ACTIVE:
        s = samples[name]
        handover = [a - b for a, b in zip(s["pd"], s["p_alone"], strict=True)]
        summary[name] = {"pd_ttft_ms": statistics.median(s["pd"]), "p_alone_ttft_ms": statistics.median(s["p_alone"]),
                         "handover_ms": statistics.median(handover), "pd_min_ms": min(s["pd"]), "pd_max_ms": max(s["pd"])}
    base = samples[baseline]["pd"]
    for name in ACTIVE:
        per_round = [a / b for a, b in zip(samples[name]["pd"], base, strict=True)]
        summary[name]["ratio_of_medians"] = summary[name]["pd_ttft_ms"] / summary[baseline]["pd_ttft_ms"]
        summary[name]["median_round_ratio"] = statistics.median(per_round)

    print(f"P/D TTFT through pdkv's proxy, {args.prompt_tokens}-token fresh prompts (seed {seed}), {args.rounds} rounds "
          f"(median; ratio to {baseline})")
    print(f"{'deployment':18} {'P/D TTFT':>10} {'P alone':>9} {'handover':>9} {'ratio':>7} {'per-round':>10}")
    for name in ACTIVE:
        s = summary[name]
        print(f"{name:18} {s['pd_ttft_ms']:8.1f}ms {s['p_alone_ttft_ms']:7.1f}ms {s['handover_ms']:7.1f}ms "
              f"{s['ratio_of_medians']:7.2f} {s['median_round_ratio']:10.2f}")

    traces: dict[str, dict] = {}
    from pdkv.trace import run_trace
    from pdkv.trace.assemble import summarize

    for name in (n for n in ACTIVE if n.startswith("pdkv")):
        got = [run_trace(urls(name).proxy, prompt=" ".join(f"t{i}" for i in fresh()), max_tokens=128) for _ in range(args.traces)]
        summ = summarize(got)
        phases = {p.name: p.p50_ms for p in summ.phases}
        write = [t.transfer.write_ms for t in got if t.transfer is not None and t.transfer.write_ms is not None]
        gbps = [t.transfer.achieved_gbps for t in got if t.transfer is not None and t.transfer.achieved_gbps is not None]
        # Descriptors a write: 36 (one a layer) where D's blocks lie back to back, up to 36 x 63 where they scattered.
        descriptors = [t.transfer.descriptors for t in got if t.transfer is not None]
        fine = {f"{a} -> {b}": statistics.median(gaps) for a, b in FINE if (gaps := _gaps(got, a, b))}
        traces[name] = {"phases_p50_ms": phases, "fine_p50_ms": fine,
                        "client_ttft_p50_ms": summ.client_ttft.p50_ms if summ.client_ttft else None,
                        "write_ms_p50": statistics.median(write) if write else None,
                        "achieved_gbps_p50": statistics.median(gbps) if gbps else None,
                        "bytes": got[-1].transfer.bytes if got[-1].transfer else None,
                        "descriptors": descriptors}
        print(f"\n{name}: seed request traced {args.traces}x, p50 per phase (ms):")
        for pname, ms in phases.items():
            print(f"  {pname:34} {ms:8.2f}")
        print("  within the handover, event to event:")
        for pname, ms in fine.items():
            print(f"    {pname:40} {ms:8.2f}")
        print(f"  client TTFT p50 {traces[name]['client_ttft_p50_ms']}; KV write p50 {traces[name]['write_ms_p50']} ms "
              f"({traces[name]['achieved_gbps_p50']} Gb/s) for {traces[name]['bytes']} B in {descriptors} descriptors")
    if args.json:
        args.json.write_text(json.dumps({"prompt_seed": seed, "baseline": baseline, "samples": samples, "summary": summary,
                                         "traces": traces}, indent=1))
    return 0


# The handover's events one by one (pdkv.connector.timing): where the ms between P's forward and D's step go. Written
# layer by layer (pdkv-socket-layers) the write starts inside P's forward (p_forward_done -> transfer_start below 0);
# p_forward_done -> transfer_end is then what is left of it once the forward is done.
FINE = (("p_forward_done", "transfer_start"), ("transfer_start", "kv_ready"), ("kv_ready", "transfer_end"),
        ("p_forward_done", "transfer_end"), ("transfer_end", "reply_sent"), ("reply_sent", "notified"),
        ("notified", "reported"), ("reported", "first_token_scheduled"))


def _gaps(traces, a: str, b: str) -> list[float]:
    """b - a in ms, for each trace that recorded both."""
    out = []
    for t in traces:
        at = {e.name: e.at for e in t.events}
        if a in at and b in at:
            out.append((at[b] - at[a]) * 1e3)
    return out


if __name__ == "__main__":
    sys.exit(main())

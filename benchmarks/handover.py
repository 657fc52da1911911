"""Handover benchmark: P/D TTFT minus the TTFT of the same prompt served by P alone.

The handover is what P/D disaggregation adds to a request's first token:
P's next scheduler step, the KV transfer, D noticing, and D's one-token
forward (steps 23-39). Measured side by side in one run for pdkv's
connector and vLLM's own MooncakeConnector (behind the test-only CPU shim
in tests/shims/cpu_accelerator), each as a 1P1D pair on the tiny model,
P's processes bound to core 0 and D's to core 1, prefix caching off (so P
alone and P/D both compute the whole prompt), requests through pdkv's proxy,
one at a time. pdkv runs twice: `pdkv/cma`, the transport `pdkv up` picks for
a 1P1D on one CPU host (P writes into D's memory with process_vm_writev), and
`pdkv/tcp`, Mooncake tcp on loopback like vLLM's connector. A `+key` suffix
(`pdkv/cma+key`) runs that pair with the deployment key set (every side-channel
frame sealed, docs/security.md); beside the same run without it, the verdict
says what the key costs.

    flock /tmp/pdkv-vllm.lock python benchmarks/handover.py --prompts 40 --tokens 850
    python benchmarks/handover.py --connectors pdkv/tcp,mooncake --json
    flock /tmp/pdkv-vllm.lock python benchmarks/handover.py --connectors pdkv/cma,pdkv/cma+key,pdkv/cma,pdkv/cma+key

Prints median and p99 handover per connector, how many P/D answers equal
P alone's (greedy, so all of them when the KV arrived whole), and the target check
for each pdkv run: its median at most half of vLLM's, its p99 under 3x its median.
For pdkv it also splits the handover with the connector's own records
(fetched from P's side channel, as `pdkv trace` does): median per phase,
and the phases of the slowest requests.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from pdkv.deploy.plan.engine import EngineSpec, engine_launch
from pdkv.deploy.run.process import ManagedProcess

VOCAB_HIGH = 4000  # set from the model's config in main()
SHIM = Path(__file__).resolve().parents[1] / "tests" / "shims" / "cpu_accelerator"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ttft(client: httpx.Client, url: str, body: dict, headers: dict | None = None, at: dict | None = None) -> float:
    """Seconds from sending a streamed completion to its first content chunk; `at` gets both as unix
    times and the answer's text (to check that P/D answers what P alone answers).

    `client` is made once per run and keeps its connections, as a load generator's would: a client
    made per request would put its own setup (an SSL context, a TCP connect) into every TTFT."""
    content = json.dumps({**body, "stream": True}).encode()
    t0 = time.perf_counter()
    sent = time.time()
    text = []
    headers = {"Content-Type": "application/json", **(headers or {})}
    with client.stream("POST", f"{url}/v1/completions", content=content, headers=headers) as r:
        if r.status_code >= 400:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        first = None
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if first is None:
                    first = time.perf_counter() - t0
                text += [c.get("text", "") for c in json.loads(line[6:]).get("choices", ())]
    if first is None:
        raise RuntimeError("the stream ended without a token")
    if at is not None:
        at["client_sent"], at["client_first_token"], at["text"] = sent, sent + first, "".join(text)
    return first


# Consecutive connector events of one transfer (pdkv.connector.timing): the handover's phases.
PHASES = (
    ("client_sent", "proxy_received", "to the proxy"),
    ("proxy_received", "registered", "P queue"),
    ("registered", "p_forward_done", "P forward"),
    ("p_forward_done", "transfer_start", "wait for D's pull"),
    ("transfer_start", "transfer_end", "KV write"),
    ("transfer_end", "notified", "DONE to D"),
    ("notified", "reported", "D worker notices"),
    ("reported", "first_token_scheduled", "D scheduler notices"),
    ("first_token_scheduled", "client_first_token", "D forward to client"),
    # D's side, beside P's queue and forward: when D's pull reaches P
    ("client_sent", "pull_scheduled", "(D queue)"),
    ("pull_scheduled", "pull_received", "(D pull to P)"),
)


def connector_records(bootstrap_url: str) -> dict[str, dict[str, float]]:
    """transfer_id -> events, from every P worker registered at `bootstrap_url`."""
    from pdkv.wire import StatsQuery, StatsReply, request_once

    engines = httpx.get(f"{bootstrap_url}/query", timeout=5).json()
    out: dict[str, dict[str, float]] = {}
    for entry in engines.values():
        for ranks in entry["worker_addr"].values():
            for addr in ranks.values():
                reply = asyncio.run(request_once(addr, StatsQuery(since=0.0, limit=10_000), 5.0))
                if isinstance(reply, StatsReply):
                    for t in reply.traces:
                        out.setdefault(t.transfer_id, {}).update(t.events)
    return out


def phases_of(ev: dict[str, float]) -> dict[str, float]:
    return {name: 1000 * (ev[b] - ev[a]) for a, b, name in PHASES if a in ev and b in ev}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def run_pair(label: str, model: str, prompts: list[list[int]], warmup: int, logs: Path, extra: dict | None = None) -> dict:
    from pdkv.proxy.config import PrefillSpec, ProxyConfig
    from pdkv.proxy.server import BackgroundProxy

    label, plus, _ = label.partition("+key")
    keyed = bool(plus)
    connector, _, transport = label.partition("/")
    if keyed and connector != "pdkv":
        raise SystemExit("+key goes with pdkv's connector")
    if connector not in ("pdkv", "mooncake") or transport not in ("", "tcp", "cma") or (connector == "mooncake" and transport == "cma"):
        raise SystemExit(f"unknown connector {label!r}: use pdkv/cma, pdkv/tcp or mooncake")
    transport = transport or ("cma" if connector == "pdkv" else "tcp")
    label = (f"{connector}/{transport}" if connector == "pdkv" else connector) + ("+key" if keyed else "")

    bport = free_port()
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH", "")) if p)} if connector == "mooncake" else {}
    common = dict(
        model=model, host="127.0.0.1", transport=transport, platform="cpu", block_size=32, max_model_len=1024,
        host_ip="127.0.0.1", connector=connector, extra_env=env, extra_args=("--no-enable-prefix-caching",),
        connector_extra=dict(extra or {}) if connector == "pdkv" else {},
    )
    if keyed:  # the engines and this process (the proxy's releases, the connector records) share the key
        import secrets

        common["extra_env"] = {**env, "PDKV_TOKEN": secrets.token_hex(32)}
        os.environ["PDKV_TOKEN"] = common["extra_env"]["PDKV_TOKEN"]
    p_spec = EngineSpec(port=free_port(), role="prefill", omp_bind="0", bootstrap_port=bport, **common)
    d_spec = EngineSpec(port=free_port(), role="decode", omp_bind="1", **common)
    tag = f"{connector}-{transport}{'-key' if keyed else ''}-{time.time_ns()}"
    p = ManagedProcess(engine_launch(p_spec, name=f"p-{tag}"), logs / f"p-{tag}.log")
    d = ManagedProcess(engine_launch(d_spec, name=f"d-{tag}"), logs / f"d-{tag}.log")
    p.start()  # the launcher binds every process of P to core 0, of D to core 1
    d.start()
    try:
        p.wait_healthy(300)
        d.wait_healthy(300)
        burl = f"http://127.0.0.1:{bport}"
        config = ProxyConfig(prefill=(PrefillSpec(p.url, burl),), decode=(d.url,), port=0)
        with BackgroundProxy(config) as proxy, httpx.Client(timeout=120) as http:
            body = {"model": model, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            rng = np.random.default_rng(7)
            for _ in range(warmup):
                w = [int(x) for x in rng.integers(100, VOCAB_HIGH, size=len(prompts[0]))]
                ttft(http, p.url, {**body, "prompt": w})
                ttft(http, proxy.url, {**body, "prompt": w[::-1]})
            alone, pd, hand, rids, client, same, differ = [], [], [], [], {}, 0, []
            gc.collect()
            gc.disable()  # no collection of this process's garbage inside a timed request
            try:
                for i, ids in enumerate(prompts):
                    rid = f"hb-{connector}-{transport}-{i}-{time.time_ns()}"
                    a_at: dict = {}
                    a = ttft(http, p.url, {**body, "prompt": ids}, at=a_at)
                    client[rid] = {}
                    b = ttft(http, proxy.url, {**body, "prompt": ids}, headers={"X-Request-Id": rid}, at=client[rid])
                    pd_text = client[rid].pop("text")
                    same += a_at["text"] == pd_text
                    if a_at["text"] != pd_text:
                        differ.append({"prompt": i, "p_alone": a_at["text"], "pd": pd_text})
                    alone.append(a)
                    pd.append(b)
                    hand.append(b - a)
                    rids.append(rid)
                    gc.collect(0)
            finally:
                gc.enable()
            split = {}
            if connector == "pdkv":
                records = connector_records(burl)
                seen = httpx.get(f"{proxy.url}/pdkv/requests", params={"limit": 10_000}, timeout=10).json()
                tids = {}  # the proxy mints transfer ids: its records map the request ids to them
                for t in seen:
                    if t["request_id"] in client:
                        client[t["request_id"]]["proxy_received"] = t["received"]
                        tids[t["request_id"]] = t["transfer_id"]
                split = {rid: phases_of({**records.get(tids.get(rid, ""), {}), **client[rid]}) for rid in rids}
        by_phase: dict[str, list[float]] = {}
        for ph in split.values():
            for k, v in ph.items():
                by_phase.setdefault(k, []).append(v)
        slowest = sorted(range(len(hand)), key=lambda i: hand[i], reverse=True)[:3]
        return {
            "connector": label,
            "n": len(hand),
            "same_answer": same,  # P/D's greedy tokens equal P alone's: the KV arrived whole
            "different_answers": differ,
            "p_alone_ttft_ms_median": 1000 * statistics.median(alone),
            "pd_ttft_ms_median": 1000 * statistics.median(pd),
            "handover_ms_median": 1000 * statistics.median(hand),
            "handover_ms_p99": 1000 * pct(hand, 99),
            "handover_ms_max": 1000 * max(hand),
            "handover_ms": [round(1000 * h, 2) for h in hand],
            "phase_ms_median": {k: round(statistics.median(v), 3) for k, v in by_phase.items()},
            "slowest": [
                {"handover_ms": round(1000 * hand[i], 2), "p_alone_ms": round(1000 * alone[i], 2), "pd_ms": round(1000 * pd[i], 2),
                 "phases_ms": {k: round(v, 2) for k, v in split.get(rids[i], {}).items()}}
                for i in slowest
            ] if split else [],
        }
    finally:
        p.stop(grace=15)
        d.stop(grace=15)
        if keyed:
            os.environ.pop("PDKV_TOKEN", None)


def key_cost_us(n: int = 20_000) -> dict[str, float]:
    """What the deployment key adds to one handover's critical path, timed in this process: D seals its pull
    and P opens it, P seals its DONE reply and D opens it (pdkv's own messages, 63 blocks as in the seed).
    Interleaved with the same encoding without the key, so that both see the same machine; microseconds."""
    from pdkv.auth import FrameSealer, new_binding
    from pdkv.wire import TO_D, TO_P, PullReply, PullRequest, PullStatus, decode_reply, decode_request, encode

    pull = PullRequest(transfer_id=f"xfer-{'ab' * 16}", d_req_id="cmpl-" + "c" * 40, session="127.0.0.1:15000", tp_rank=0,
                       tp_size=1, block_ids=list(range(100, 163)), binding=new_binding()[0])
    done = PullReply(transfer_id=pull.transfer_id, d_req_id=pull.d_req_id, status=PullStatus.DONE, bytes=148_635_648, descriptors=36)
    d_side, p_side = FrameSealer("k" * 64), FrameSealer("k" * 64)
    on, off = [], []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        decode_request(p_side.open(d_side.seal(encode(pull), TO_P), TO_P)[0])
        decode_reply(d_side.open(p_side.seal(encode(done), TO_D), TO_D)[0])
        t1 = time.perf_counter_ns()
        decode_request(encode(pull))
        decode_reply(encode(done))
        t2 = time.perf_counter_ns()
        on.append(t1 - t0)
        off.append(t2 - t1)
    return {"with_key_us": statistics.median(on) / 1000, "without_key_us": statistics.median(off) / 1000,
            "added_us": (statistics.median(on) - statistics.median(off)) / 1000}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: a fresh `pdkv model tiny`)")
    ap.add_argument("--prompts", type=int, default=40, help="distinct prompts per connector (>= 30)")
    ap.add_argument("--tokens", type=int, default=850, help="tokens per prompt")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--connectors", default="pdkv/cma,pdkv/tcp,mooncake", help="comma-separated: pdkv/cma, pdkv/tcp, mooncake")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a kv_connector_extra_config entry for pdkv's connector (JSON value), e.g. wait_write_ms=0")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pdkv-handover-"))
    model = args.model
    if model is None:
        from pdkv.tinymodel import write_tiny_model

        model = str(write_tiny_model(work / "tiny"))
    rng = np.random.default_rng(2026)
    global VOCAB_HIGH
    VOCAB_HIGH = json.loads((Path(model) / "config.json").read_text())["vocab_size"] - 100
    prompts = [[int(x) for x in rng.integers(100, VOCAB_HIGH, size=args.tokens)] for _ in range(args.prompts)]
    extra = {k: json.loads(v) for k, _, v in (kv.partition("=") for kv in args.set)}
    results = [run_pair(c.strip(), model, prompts, args.warmup, work, extra) for c in args.connectors.split(",") if c.strip()]
    by: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {}
    for r in results:  # a label given more than once: its runs, pooled by median of medians
        runs.setdefault(r["connector"], []).append(r)
        by[r["connector"]] = r
    verdict = {}
    if any(name.endswith("+key") for name in runs):
        cost = key_cost_us()
        verdict["key_critical_path_added_us"] = round(cost["added_us"], 2)
        verdict["key_critical_path_at_most_0.1_ms"] = cost["added_us"] <= 100
    for name in runs:
        if name.endswith("+key") and name[:-4] in runs:
            on = statistics.median(r["handover_ms_median"] for r in runs[name])
            off = statistics.median(r["handover_ms_median"] for r in runs[name[:-4]])
            verdict[f"{name}_median_ms_over_unkeyed"] = round(on - off, 3)
            verdict[f"{name}_run_medians_ms"] = [round(r["handover_ms_median"], 2) for r in runs[name]]
            verdict[f"{name[:-4]}_run_medians_ms"] = [round(r["handover_ms_median"], 2) for r in runs[name[:-4]]]
            verdict[f"{name}_costs_at_most_0.1_ms"] = on - off <= 0.1
    for name, r in by.items():
        if not name.startswith("pdkv") or name.endswith("+key"):
            continue
        verdict[f"{name}_p99_under_3x_median"] = r["handover_ms_p99"] < 3 * r["handover_ms_median"]
        if "mooncake" in by:
            vllm = by["mooncake"]["handover_ms_median"]
            verdict[f"{name}_median_ratio_to_vllm"] = round(r["handover_ms_median"] / vllm, 3)
            verdict[f"{name}_median_at_most_half_of_vllm"] = r["handover_ms_median"] <= 0.5 * vllm
    if args.json:
        print(json.dumps({"results": results, "verdict": verdict, "logs": str(work)}, indent=2))
        return 0
    print(f"handover = P/D TTFT - P-alone TTFT; {args.prompts} prompts of {args.tokens} tokens; logs in {work}")
    print(f"{'connector':<10} {'n':>4} {'same':>5} {'P alone':>9} {'P/D':>9} {'median':>9} {'p99':>9} {'max':>9}   (ms)")
    for r in results:
        print(
            f"{r['connector']:<10} {r['n']:>4} {r['same_answer']:>5} {r['p_alone_ttft_ms_median']:>9.2f} {r['pd_ttft_ms_median']:>9.2f} "
            f"{r['handover_ms_median']:>9.2f} {r['handover_ms_p99']:>9.2f} {r['handover_ms_max']:>9.2f}"
        )
    for r in results:
        if r["phase_ms_median"]:
            print(f"{r['connector']} connector phases, median (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in r["phase_ms_median"].items()))
            for s in r["slowest"]:
                print(f"  slow: handover {s['handover_ms']} (P alone {s['p_alone_ms']}, P/D {s['pd_ms']}): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in s["phases_ms"].items()))
    for k, v in verdict.items():
        print(f"{k}: {v if not isinstance(v, bool) else 'yes' if v else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

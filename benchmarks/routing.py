"""Routing benchmark: pdkv's kv-aware policy against round-robin and vllm-router's cache_aware, same engines, same run.

Deployment (started once, every router runs in turn on it): two prefill
engines and one decode engine of pdkv's connector (pdkv/cma) on the tiny
model, prefix caching on (vLLM's default), KV cache events on every engine
(--kv-events-config), block size 32, max_model_len 2048. The machine has 2
cores for 3 engines: P0 is bound to core 0, P1 to core 1, D to core 1 as well
(VLLM_CPU_OMP_THREADS_BIND, one OMP thread each; two engines share core 1, and
the client, the proxies and the routers float over both cores).

Before the timed rounds, each workload runs once untimed through round-robin
(multi-turn) and least-outstanding (unique): the engines' first batches are
slower, and no router should be timed on them (--no-engine-warm-up skips it).

Routers, each in turn on the same engines and each in its own process. Each
first runs a small warm-up workload of other texts untimed (its connections,
tokenizer and first events); then, once every engine is idle, every engine's
prefix cache is reset (/reset_prefix_cache, VLLM_SERVER_DEV_MODE=1; then one
short request each, since an engine publishes the reset's AllBlocksCleared
event only at its next step), so each sees the same timed workload from a
cold cache. The order of the routers
rotates from round to round, and the ratios are given per round and as the
median of rounds beside the ratio of means:
- `rr`: pdkv proxy, --policy round-robin
- `kv`: pdkv proxy, --policy kv-aware, --local-prefill-tokens 0 (always P/D)
- `kv+local:N`: pdkv proxy, --policy kv-aware, --local-prefill-tokens N
- `vllm-router`: vllm-router --vllm-pd-disaggregation --prefill-policy cache_aware
  (--kv-connector mooncake: the kv_transfer_params of vLLM's MooncakeConnector, which pdkv's connector reads)

Multi-turn workload: `--conversations` chats (16) of `--turns` turns (6),
all under one shared system prompt (`--system-words`, ~1 token a word), each
user turn `--turn-words` new words, each answer `--answer-tokens` tokens
(greedy, ignore_eos) fed back into the history; every conversation runs its
turns in order and all conversations run at once, so their turns interleave.
Streaming /v1/chat/completions; TTFT is the client's send to the first SSE
event. The prefix hit rate is each engine's own (vllm:prefix_cache_hits /
vllm:prefix_cache_queries over the run, from its /metrics): P's (both
prefills together), D's, and all three. `P0 share` is P0's part of the
prompt tokens the two prefills were asked for (vllm:prefix_cache_queries):
how a router split the prefill work between the core P0 has to itself and
the core P1 shares with D. `cpu ms` is the router process's CPU time (user +
system, its children too) over the timed run, per request.

Unique-prompt workload (`--unique N`, 0: off): N completions of prompts that
share no block, `--unique-concurrency` at once, through pdkv's
least-outstanding and kv-aware policies (the latter with the chosen
--local-prefill-tokens), `--unique-rounds` rounds: each round both on the
same prompts, in alternating order; kv-aware's req/s against
least-outstanding's, over all rounds and round by round.

    flock /tmp/pdkv-vllm.lock timeout -k 60 3000 python benchmarks/routing.py --vllm-router /tmp/vr-venv/bin/vllm-router

Prints a table (and writes routing.json in the logs folder; --json prints it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from routing_workloads import SERVED, counters, free_port, multi_turn, rate, unique

from pdkv.deploy.plan.engine import EngineSpec, engine_launch, kv_events_endpoints
from pdkv.deploy.run.process import ManagedProcess

BLOCK = 32


class Deployment:
    def __init__(self, model: str, logs: Path) -> None:
        self.model = model
        self.boot = [free_port(), free_port()]
        self.events = [free_port(pair=True) for _ in range(3)]
        common = dict(model=model, served_model_name=SERVED, host="127.0.0.1", transport="cma", platform="cpu", block_size=BLOCK,
                      max_model_len=2048, host_ip="127.0.0.1", connector="pdkv", extra_env={"VLLM_SERVER_DEV_MODE": "1"})
        specs = [
            EngineSpec(port=free_port(), role="prefill", omp_bind="0", bootstrap_port=self.boot[0], kv_events_port=self.events[0],
                       **common),
            EngineSpec(port=free_port(), role="prefill", omp_bind="1", bootstrap_port=self.boot[1], kv_events_port=self.events[1],
                       **common),
            EngineSpec(port=free_port(), role="decode", omp_bind="1", kv_events_port=self.events[2], **common),
        ]
        names = ["p0", "p1", "d"]
        self.engines = [ManagedProcess(engine_launch(s, name=n), logs / f"{n}.log") for s, n in zip(specs, names, strict=True)]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def wait_idle(self, timeout: float = 120) -> None:
        """Until no engine runs or queues a request (the last router's stragglers do not land in the next one's run)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            busy = 0.0
            for url in self.urls:
                for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
                    if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                        busy += sum(x.value for x in family.samples)
            if busy == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"engines still busy after {timeout} s")

    def reset_caches(self) -> None:
        """Every engine's prefix cache emptied, and the kv-aware proxies told so. An engine publishes its KV events
        (AllBlocksCleared too) only when it next runs a step, so each is then sent one short request of its own
        (no full block, so nothing it stores) and the events are given a moment to land."""
        import httpx

        for url in self.urls:
            for _ in range(50):
                r = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
                if r.status_code == 200 and "false" not in r.text.lower():
                    break
                time.sleep(0.2)
        for url in self.urls:
            httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "step", "max_tokens": 1}, timeout=60).raise_for_status()
        time.sleep(0.5)

    def pdkv_proxy_argv(self, policy: str, port: int, local: int = 0, tokenizer: str | None = None,
                        kv_file: Path | None = None) -> list[str]:
        """`pdkv proxy` in its own process, as it is deployed (in this process it would share the client's GIL)."""
        p0, p1, d = self.urls
        argv = [sys.executable, "-m", "pdkv", "proxy", "-p", f"{p0},{self.boot[0]}", "-p", f"{p1},{self.boot[1]}", "-d", d,
                "--port", str(port), "--policy", policy, "--health-interval", "1"]
        if policy == "kv-aware":
            for url, events in zip(self.urls, self.events, strict=True):
                argv += ["--kv-events", f"{url}={','.join(kv_events_endpoints('127.0.0.1', events))}"]
            argv += ["--local-prefill-tokens", str(local)] + (["--tokenizer", tokenizer] if tokenizer else [])
            argv += ["--config", str(kv_file)] if kv_file else []
        return argv


def wait_http(url: str, timeout: float) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not healthy in {timeout} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its children so far."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def warm_up_args(args: argparse.Namespace) -> argparse.Namespace:
    """A small workload of its own (other texts, other prompts) that each router runs untimed before its timed one."""
    return argparse.Namespace(**{**vars(args), "conversations": 2, "turns": 2, "seed": args.seed + 99, "stagger_s": 0.0,
                                 "unique": 2 * args.unique_concurrency})


def run_router(dep: Deployment, router: str, args: argparse.Namespace, logs: Path, workload: str, seed: int) -> dict:
    p_urls, d_urls = dep.urls[:2], dep.urls[2:]
    extra: dict = {}
    before_p: list = []
    before_d: list = []

    def go(url: str, pid: int, after_warm_up=lambda: None) -> dict:
        """An untimed warm-up through this router (its connections, its tokenizer, its first events), then, on idle
        engines with cold prefix caches, the timed run, with the router's CPU time per request over it (`pid`: its process)."""
        nonlocal before_p, before_d
        warm = warm_up_args(args)
        asyncio.run(multi_turn(url, warm) if workload == "multi-turn" else unique(url, warm, seed + 5_000))
        dep.wait_idle()
        after_warm_up()
        dep.reset_caches()
        before_p, before_d = [counters(u) for u in p_urls], [counters(u) for u in d_urls]
        cpu0 = cpu_seconds(pid)
        row = asyncio.run(multi_turn(url, args) if workload == "multi-turn" else unique(url, args, seed))
        row["router_cpu_ms_per_req"] = round((cpu_seconds(pid) - cpu0) * 1000 / max(row["completed"], 1), 2)
        return row

    if router == "vllm-router":
        port = free_port()
        argv = [args.vllm_router, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                "--prefill", p_urls[0], str(dep.boot[0]), "--prefill", p_urls[1], str(dep.boot[1]), "--decode", d_urls[0],
                "--prefill-policy", "cache_aware", "--decode-policy", "round_robin", "--kv-connector", "mooncake",
                "--prometheus-port", str(free_port())]
        with (logs / "vllm-router.log").open("a") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_http(f"http://127.0.0.1:{port}", 60)
            row = go(f"http://127.0.0.1:{port}", proc.pid)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
    else:
        import httpx

        policy, _, local = router.partition(":")
        policy = {"rr": "round-robin", "lo": "least-outstanding", "kv": "kv-aware", "kv+local": "kv-aware"}[policy]
        port = free_port()
        kv_file = None
        if args.kv_set:  # [kv] keys of the proxy's TOML file, e.g. metrics_interval_s=0
            kv_file = logs / f"kv-{port}.toml"
            kv_file.write_text("[kv]\n" + "".join(f"{k.strip()} = {v.strip()}\n" for k, _, v in (x.partition("=") for x in args.kv_set)))
        argv = dep.pdkv_proxy_argv(policy, port, int(local or 0), None if args.engine_tokenize else dep.model, kv_file)
        url = f"http://127.0.0.1:{port}"
        with (logs / f"proxy-{router.replace(':', '-')}.log").open("a") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_http(url, 60)
            if policy == "kv-aware":  # the self-checks run first, on their own prompts
                end = time.monotonic() + 40
                while time.monotonic() < end:
                    checks = httpx.get(f"{url}/health", timeout=5).json().get("kv_self_checks") or {}
                    if len(checks) == 3:
                        break
                    time.sleep(0.2)
                extra["self_checks"] = checks
            warm_ids: set = set()

            def seen_so_far() -> None:  # the warm-up's records, left out of the counts below
                warm_ids.update(t.get("request_id") for t in httpx.get(f"{url}/pdkv/requests?limit=100000", timeout=30).json())

            row = go(url, proc.pid, seen_so_far)
            timings = [t for t in httpx.get(f"{url}/pdkv/requests?limit=100000", timeout=30).json() if t.get("request_id") not in warm_ids]
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        extra["local"] = sum(1 for t in timings if t.get("local_prefill") == "kv_local")
        extra["pd"] = sum(1 for t in timings if not t.get("local_prefill"))
        took = [float(t["route"].rsplit("tokenized in ", 1)[1].split()[0]) for t in timings if "tokenized in" in (t.get("route") or "")]
        extra["tokenize_ms_p50"] = round(float(np.median(took)), 2) if took else None
    after_p, after_d = [counters(u) for u in p_urls], [counters(u) for u in d_urls]
    row.update(extra)
    row["hit_p"] = rate(before_p, after_p)
    row["hit_d"] = rate(before_d, after_d)
    row["hit_all"] = rate(before_p + before_d, after_p + after_d)
    queried = [a[1] - b[1] for a, b in zip(after_p, before_p, strict=True)]  # prompt tokens each prefill was asked for
    row["p0_share"] = round(queried[0] / sum(queried), 3) if sum(queried) > 0 else None
    return {"router": router, "workload": workload, **row}


def ratios(rows: list[dict]) -> dict:
    """Per router, the mean over rounds of TTFT p50 and req/s; then the ratios the targets name."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["workload"], r["router"]), []).append(r)
    mean = {k: {m: round(float(np.mean([r[m] for r in v])), 3) for m in ("ttft_p50_ms", "ttft_p99_ms", "req_s")} for k, v in by.items()}
    out: dict = {"means": {f"{w}/{r}": v for (w, r), v in mean.items()}}

    def by_round(w: str, r: str, base: str, metric: str) -> None:
        """Round by round, against `base` in the same round: the spread says how much of the ratio is the machine."""
        ref = {x["round"]: x[metric] for x in by.get((w, base), [])}
        per = [x[metric] / ref[x["round"]] for x in by[(w, r)] if ref.get(x["round"])]
        if per:
            out[f"{w} {r} {metric} / {base} by round"] = [round(x, 3) for x in per]
            out[f"{w} {r} {metric} / {base}, median of rounds"] = round(float(np.median(per)), 3)

    for (w, r), v in mean.items():
        if w == "multi-turn" and r.startswith("kv"):
            for base in ("rr", "vllm-router"):
                if ("multi-turn", base) in mean:
                    out[f"{r} TTFT p50 / {base}"] = round(v["ttft_p50_ms"] / mean[("multi-turn", base)]["ttft_p50_ms"], 3)
                    by_round(w, r, base, "ttft_p50_ms")
        if w == "unique" and r.startswith("kv") and ("unique", "lo") in mean:
            out[f"unique {r} req/s / lo"] = round(v["req_s"] / mean[("unique", "lo")]["req_s"], 3)
            by_round(w, r, "lo", "req_s")
    return out


def render(rows: list[dict]) -> str:
    head = (f"{'workload':<11} {'router':<16} {'req/s':>6} {'TTFT p50':>9} {'p99':>8} {'hit P':>6} {'hit D':>6} {'hit all':>7} "
            f"{'P0 share':>8} {'cpu ms':>6} {'local':>5} {'ok':>4} {'fail':>4}")
    lines = [head, "-" * len(head)]
    for r in rows:
        def f(x, spec=".1f"):
            return "-" if x is None else format(x, spec)
        lines.append(f"{r['workload']:<11} {r['router']:<16} {f(r['req_s'], '.2f'):>6} {f(r['ttft_p50_ms']):>9} {f(r['ttft_p99_ms']):>8} "
                     f"{f(r['hit_p'], '.2f'):>6} {f(r['hit_d'], '.2f'):>6} {f(r['hit_all'], '.2f'):>7} {f(r.get('p0_share'), '.2f'):>8} "
                     f"{f(r.get('router_cpu_ms_per_req'), '.2f'):>6} {r.get('local', '-'):>5} {r['completed']:>4} {r['failed']:>4}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: a fresh tiny model)")
    ap.add_argument("--routers", default="rr,kv,kv+local:64,kv+local:128,kv+local:256,vllm-router",
                    help="comma-separated: rr, lo, kv, kv+local:N, vllm-router")
    ap.add_argument("--vllm-router", default=shutil.which("vllm-router"), help="the vllm-router executable (absent: its row is skipped)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--turn-words", type=int, default=60)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--stagger-s", type=float, default=2.0, help="conversations start at uniform random offsets in [0, this)")
    ap.add_argument("--unique", type=int, default=192, help="unique-prompt requests per router (0: no unique-prompt workload)")
    ap.add_argument("--unique-words", type=int, default=250)
    ap.add_argument("--unique-concurrency", type=int, default=8)
    ap.add_argument("--unique-local", type=int, default=128, help="kv-aware's --local-prefill-tokens on the unique workload")
    ap.add_argument("--unique-rounds", type=int, default=4, help="rounds of the unique workload: both routers, the same prompts")
    ap.add_argument("--kv-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a [kv] setting of the kv-aware proxies (TOML value), e.g. metrics_interval_s=0; repeatable")
    ap.add_argument("--engine-tokenize", action="store_true", help="kv-aware asks the engine's /tokenize (default: --tokenizer MODEL)")
    ap.add_argument("--rounds", type=int, default=2, help="repeat the multi-turn routers this many times, interleaved")
    ap.add_argument("--no-engine-warm-up", dest="engine_warm_up", action="store_false",
                    help="skip the untimed first pass of each workload (round-robin, least-outstanding) before the timed rounds")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--logs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="pdkv-routing-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from pdkv.tinymodel import write_tiny_model

        model = str(write_tiny_model(logs / "tiny"))
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    if "vllm-router" in routers and not args.vllm_router:
        print("vllm-router not found (--vllm-router PATH): its row is skipped", file=sys.stderr)
        routers.remove("vllm-router")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    dep = Deployment(model, logs)
    rows: list[dict] = []

    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    with dep.engines[0], dep.engines[1], dep.engines[2]:
        for e in dep.engines:
            e.wait_healthy(400)
        say("engines healthy")
        if args.engine_warm_up:  # the engines' first batches are slower, whichever router sends them: none is timed
            for router, workload in (("rr", "multi-turn"), ("lo", "unique")):
                if workload == "multi-turn" and args.rounds or workload == "unique" and args.unique:
                    row = run_router(dep, router, args, logs, workload, 0)
                    say(f"engine warm-up, untimed: {workload} through {router}: {json.dumps(row)}")
        for rnd in range(args.rounds):  # the routers rotate, so none is always first after another
            for router in routers[rnd % len(routers):] + routers[:rnd % len(routers)]:
                row = run_router(dep, router, args, logs, "multi-turn", 0)
                row["round"] = rnd
                rows.append(row)
                say(json.dumps(row))
        if args.unique:
            kv = f"kv+local:{args.unique_local}"
            for rnd in range(args.unique_rounds):  # both routers on the same prompts each round, in alternating order
                for router in ("lo", kv) if rnd % 2 == 0 else (kv, "lo"):
                    row = run_router(dep, router, args, logs, "unique", 10_000 * (rnd + 1))
                    row["round"] = rnd
                    rows.append(row)
                    say(json.dumps(row))
    report = {"command": ["benchmarks/routing.py", *(sys.argv[1:] if argv is None else argv)], "args": vars(args), "rows": rows,
              "ratios": ratios(rows),
              "wall_s": round(time.time() - started, 1), "logs": str(logs)}
    (logs / "routing.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.conversations} conversations x {args.turns} turns, system {args.system_words} words, turns {args.turn_words} words, "
              f"answers {args.answer_tokens} tokens; {report['wall_s']} s; logs in {logs}")
        print(render(rows))
        for k, v in report["ratios"].items():
            if k != "means":
                print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

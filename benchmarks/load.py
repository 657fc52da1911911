"""Load benchmark: vLLM's own benchmark client against a 1P1D pair, next to P alone.

What a user weighing P/D disaggregation asks: at a given concurrency, does a
prefill/decode pair serve more requests per second, with what time to first
token, than the one engine it started from? This drives vLLM's benchmark
client (`vllm.benchmarks.serve`, in this process: a parser from
`add_cli_args`, then `main(args)`) through pdkv's proxy (BackgroundProxy) at
a real local 1P1D pair on the tiny model, at each `--concurrency`
(`--max-concurrency`), and in the same run, at the same concurrencies, at the
same prefill engine alone (the client pointed straight at P's URL, no P/D).
Each P/D row's req/s and TTFT p50 is also given as a ratio to P alone's.

Deployments (each started once, all concurrencies run on it, then stopped):
`pdkv/cma` (pdkv's connector, P writes into D's memory with
process_vm_writev), `pdkv/tcp` (pdkv's connector over Mooncake tcp on
loopback) and `mooncake` (vLLM's own MooncakeConnector over tcp, behind the
test-only CPU shim in tests/shims/cpu_accelerator).

    flock /tmp/pdkv-vllm.lock timeout -k 60 3600 python benchmarks/load.py
    flock /tmp/pdkv-vllm.lock timeout -k 60 900 python benchmarks/load.py --deployments pdkv/cma,mooncake --concurrency 1,8 --json

Setup: P's processes bound to core 0, D's to core 1 (pdkv.deploy.plan.engine does it);
the client and the proxy run in this process (two event loops, one GIL),
unbound, on the same two cores (the machine has no third). P alone therefore
computes on one core where P/D computes on two, and P/D's rows carry the
proxy's work in the client's process. Engines: block size 32, max_model_len 1024, the tiny
model (`pdkv.tinymodel.write_tiny_model`, served as `tiny`).
Workload: 256-token prompts, 32 output tokens, `--ignore-eos`, given to the
client as a file in its ShareGPT format (`--dataset-name sharegpt
--dataset-path FILE --sharegpt-output-len 32 --disable-shuffle`; its
`custom` JSONL reader needs pandas, which is not installed); `--num-prompts
max(--min-prompts, --prompts-per-concurrency x concurrency)`: 32, 64, 256,
512 for 1, 8, 32, 64 by default (on the tiny model a request takes tens of
ms; a run of a few waves of requests would be mostly its own ramp-up and
drain). At each concurrency P alone runs first, then P/D.

Prefix caching is left at vLLM's default (on), with prompts that share no
cached block, so hits are negligible (P's hit rate per run, from its
/metrics, is in the table). The prompts are drawn here, not by the client's
`--dataset-name random`: that dataset builds each prompt from consecutive
token ids, `(offset + index + arange(input_len)) % vocab`, and the tiny
tokenizer has 593 tokens, so it has fewer than 600 distinct prompts to give
(the first run with it had P's prefix cache hit rate at 20-79%). Here each
token is drawn uniformly from the tokenizer's non-special tokens, the prompt
is brought to exactly `--input-len` tokens after a decode-encode round trip,
and no two prompts of the whole invocation share their first block (checked,
so no prompt can reuse another's cached blocks). The client's ready check is
skipped (its test request would be the run's first prompt, a cache hit);
instead each deployment is warmed up with `--warmup` requests to P alone and
through P/D, at the largest concurrency, before the timed runs.

Prints one table: per deployment and concurrency, P alone's row and P/D's,
with req/s, TTFT p50/p99, TPOT p50 (ms), completed and failed requests, the
ratios, P's prefix cache hit rate over the run, and how much CPU processes outside the run (neither the engines nor
this process) used meanwhile, in cores on average: the machine is shared,
and on 2 cores another job's 0.5 core is felt; failure reasons (the
client's error strings, counted) under it.
`--json` prints the whole result instead; it is also written to load.json in
the logs folder the run names, beside the client's own output per run and
every engine's log.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pdkv.deploy.plan.engine import EngineSpec, engine_launch
from pdkv.deploy.run.process import ManagedProcess

SHIM = Path(__file__).resolve().parents[1] / "tests" / "shims" / "cpu_accelerator"
SERVED_NAME = "tiny"
DEPLOYMENTS = ("pdkv/cma", "pdkv/tcp", "mooncake")
KEPT = ("request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "completed", "failed", "duration")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_deployment(label: str) -> tuple[str, str]:
    """`pdkv/cma`, `pdkv/tcp` or `mooncake` -> (connector, transport)."""
    connector, _, transport = label.strip().partition("/")
    if connector == "pdkv" and transport in ("cma", "tcp"):
        return connector, transport
    if connector == "mooncake" and transport in ("", "tcp"):
        return connector, "tcp"
    raise SystemExit(f"unknown deployment {label!r}: use pdkv/cma, pdkv/tcp or mooncake")


TICK = os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> float:
    """CPU seconds every process of this machine has spent since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICK


def own_cpu_s(groups: set[int]) -> float:
    """CPU seconds spent by this process and by the live processes of the process groups `groups` (the engines)."""
    total, me = 0, os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on; the name may hold spaces
        if int(entry.name) == me or int(fields[2]) in groups:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICK


class PromptSource:
    """Prompts of uniformly random tokens, no two of them (over this object's life) with the same first block.

    Used from the main thread only."""

    def __init__(self, tokenizer_dir: str, block_size: int = 32) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        special = set(self.tok.all_special_ids)
        self.allowed = np.array([i for i in range(self.tok.vocab_size) if i not in special])
        self.block_size = block_size
        self.first_blocks: set[tuple[int, ...]] = set()

    def prompt(self, rng: np.random.Generator, length: int) -> str:
        for _ in range(100):
            ids = rng.choice(self.allowed, length).tolist()
            # decoding random byte-level tokens and encoding the text again need not give the same tokens
            for _ in range(20):
                text = self.tok.decode(ids)
                ids = self.tok.encode(text, add_special_tokens=False)
                if len(ids) == length:
                    break
                ids = ids[:length] + rng.choice(self.allowed, max(0, length - len(ids))).tolist()
            else:
                continue
            key = tuple(ids[: self.block_size])
            if key not in self.first_blocks:
                self.first_blocks.add(key)
                return text
        raise RuntimeError(f"could not draw a fresh {length}-token prompt")

    def write(self, path: Path, n: int, length: int, seed: int) -> Path:
        """`n` prompts in the client's ShareGPT format (its `custom` JSONL needs pandas, which vLLM
        leaves optional); the client's `--sharegpt-output-len` replaces the one-word answers."""
        rng = np.random.default_rng(seed)
        turns = [{"conversations": [{"from": "human", "value": self.prompt(rng, length)}, {"from": "gpt", "value": "-"}]} for _ in range(n)]
        path.write_text(json.dumps(turns))
        return path


def prefix_cache_counters(url: str) -> tuple[float, float]:
    """(hits, queries) of an engine's prefix cache, in tokens, from its Prometheus /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    found = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.name in found:
            found[family.name] += sum(x.value for x in family.samples if x.name.endswith("_total"))
    return found["vllm:prefix_cache_hits"], found["vllm:prefix_cache_queries"]


def client_run(base_url: str, dataset: Path, tokenizer: str, concurrency: int, prompts: int, output_len: int,
               log: Path, tag: str, groups: set[int], p_url: str) -> dict:
    """One `vllm.benchmarks.serve` run over the prompts in `dataset`: the client's numbers, its errors
    counted by message, P's prefix cache hit rate over the run (`p_url`: P's server), and
    `others_cores`, the CPU that processes outside this run (not this process, not the engines'
    process groups `groups`) used meanwhile, in cores on average: the machine is shared.

    The client's printout goes to `log`. An exception from the client (it
    raises when it cannot start) is returned as the row's `error`."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", SERVED_NAME, "--tokenizer", tokenizer,
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--sharegpt-output-len", str(output_len),
        "--disable-shuffle",
        "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--ready-check-timeout-sec", "0", "--disable-tqdm", "--temperature", "0",
        # request ids unique across runs: the proxy derives each transfer id from one
        "--request-id-prefix", f"load-{tag}-{time.time_ns()}-",
        "--save-detailed",  # keeps the per-request errors in the returned dict; nothing is written
    ])
    log.parent.mkdir(parents=True, exist_ok=True)
    hits0, queries0 = prefix_cache_counters(p_url)
    t0, machine0, own0 = time.monotonic(), machine_cpu_s(), own_cpu_s(groups)
    with log.open("a") as out, contextlib.redirect_stdout(out):
        print(f"=== {tag}: {base_url}, concurrency {concurrency}, {prompts} prompts from {dataset}")
        try:
            result = serve.main(args)
        except Exception as exc:  # noqa: BLE001 - the row reports it; the other runs go on
            print(f"client failed: {exc!r}")
            result = {"completed": 0, "failed": prompts, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({k: result.get(k) for k in KEPT}))
    wall = time.monotonic() - t0
    others = max(0.0, (machine_cpu_s() - machine0) - (own_cpu_s(groups) - own0))
    hits1, queries1 = prefix_cache_counters(p_url)
    row = {k: result.get(k) for k in (*KEPT, "error") if k in result}
    errors = collections.Counter(e.strip()[:400] for e in result.get("errors") or () if e)
    row["errors"] = dict(errors.most_common(5))
    row["others_cores"] = round(others / wall, 2)
    row["p_prefix_hit_rate"] = round((hits1 - hits0) / (queries1 - queries0), 4) if queries1 > queries0 else None
    return row


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def run_deployment(label: str, model: str, concurrencies: list[int], args: argparse.Namespace, logs: Path, extra: dict,
                   prompts: PromptSource) -> dict:
    from pdkv.proxy.config import PrefillSpec, ProxyConfig
    from pdkv.proxy.server import BackgroundProxy

    connector, transport = parse_deployment(label)
    label = f"{connector}/{transport}" if connector == "pdkv" else connector
    slug = label.replace("/", "-")
    bport = free_port()
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH", "")) if p)} if connector == "mooncake" else {}
    common = dict(
        model=model, served_model_name=SERVED_NAME, host="127.0.0.1", transport=transport, platform="cpu",
        block_size=32, max_model_len=1024, host_ip="127.0.0.1", connector=connector, extra_env=env,
        connector_extra=dict(extra) if connector == "pdkv" else {},
    )
    p_spec = EngineSpec(port=free_port(), role="prefill", omp_bind="0", bootstrap_port=bport, **common)
    d_spec = EngineSpec(port=free_port(), role="decode", omp_bind="1", **common)
    p = ManagedProcess(engine_launch(p_spec, name=f"p-{slug}"), logs / f"p-{slug}.log")
    d = ManagedProcess(engine_launch(d_spec, name=f"d-{slug}"), logs / f"d-{slug}.log")
    rows: list[dict] = []

    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {label}: {msg}", file=sys.stderr, flush=True)

    try:
        # ManagedProcess as a context: both engines' process groups are stopped on every exit path
        with p, d:
            p.wait_healthy(300)
            d.wait_healthy(300)
            say("P and D healthy")
            config = ProxyConfig(prefill=(PrefillSpec(p.url, f"http://127.0.0.1:{bport}"),), decode=(d.url,), port=0)
            groups = {p.pid, d.pid}  # each engine leads its own process group (start_new_session)
            with BackgroundProxy(config) as proxy:

                def run(url: str, concurrency: int, n: int, tag: str) -> dict:
                    nonlocal seed
                    seed += 1
                    dataset = prompts.write(logs / f"prompts-{slug}-{tag}.json", n, args.input_len, seed)
                    return client_run(url, dataset, model, concurrency, n, args.output_len,
                                      logs / f"client-{slug}.log", f"{slug}-{tag}", groups, p.url)

                seed = args.seed
                if args.warmup:
                    for url, tag in ((p.url, "warm-alone"), (proxy.url, "warm-pd")):
                        # at the largest concurrency: the batch shapes of the timed runs are seen once
                        w = run(url, min(args.warmup, max(concurrencies)), args.warmup, tag)
                        say(f"warm-up {tag}: {w.get('completed')} completed, {w.get('failed')} failed")
                for c in concurrencies:
                    n = max(args.min_prompts, args.prompts_per_concurrency * c)
                    alone = run(p.url, c, n, f"alone-c{c}")
                    say(f"c={c} P alone: {alone.get('request_throughput') or 0:.2f} req/s, {alone.get('failed')} failed")
                    pd = run(proxy.url, c, n, f"pd-c{c}")
                    say(f"c={c} P/D: {pd.get('request_throughput') or 0:.2f} req/s, {pd.get('failed')} failed")
                    rows.append({
                        "concurrency": c, "num_prompts": n, "p_alone": alone, "pd": pd,
                        "req_s_ratio": ratio(pd.get("request_throughput"), alone.get("request_throughput")),
                        "ttft_p50_ratio": ratio(pd.get("median_ttft_ms"), alone.get("median_ttft_ms")),
                    })
            say("stopping")
    except Exception as exc:  # noqa: BLE001 - one deployment that cannot start must not cost the others' rows
        say(f"failed: {exc}")
        return {"deployment": label, "rows": rows, "error": f"{type(exc).__name__}: {exc}"}
    return {"deployment": label, "rows": rows}


def fmt(x: float | int | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def render(results: list[dict]) -> str:
    head = (
        "| deployment | conc | prompts | served by | req/s | TTFT p50 | TTFT p99 | TPOT p50 | completed | failed "
        "| req/s vs P alone | TTFT p50 vs P alone | P prefix hits | others' CPU (cores) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    notes = []
    for dep in results:
        for r in dep["rows"]:
            for who, m in (("P alone", r["p_alone"]), ("P/D", r["pd"])):
                lines.append(
                    f"| {dep['deployment']} | {r['concurrency']} | {r['num_prompts']} | {who} | {fmt(m.get('request_throughput'))} "
                    f"| {fmt(m.get('median_ttft_ms'), '.1f')} | {fmt(m.get('p99_ttft_ms'), '.1f')} | {fmt(m.get('median_tpot_ms'), '.1f')} "
                    f"| {fmt(m.get('completed'), 'd')} | {fmt(m.get('failed'), 'd')} "
                    + (f"| {fmt(r['req_s_ratio'], '.3f')} | {fmt(r['ttft_p50_ratio'], '.3f')} " if who == "P/D" else "| | ")
                    + f"| {fmt(None if m.get('p_prefix_hit_rate') is None else 100 * m['p_prefix_hit_rate'], '.1f')}% "
                    + f"| {fmt(m.get('others_cores'))} |"
                )
                for msg, count in (m.get("errors") or {}).items():
                    notes.append(f"{dep['deployment']} c={r['concurrency']} {who}: {count} x {msg}")
                if m.get("error"):
                    notes.append(f"{dep['deployment']} c={r['concurrency']} {who}: client failed: {m['error']}")
    notes += [f"{dep['deployment']}: {dep['error']}" for dep in results if dep.get("error")]
    out = "\n".join(lines)
    if notes:
        out += "\n\nfailures (the client's error strings, counted):\n" + "\n".join(f"- {n}" for n in notes)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: a fresh tiny model, pdkv.tinymodel)")
    ap.add_argument("--deployments", default=",".join(DEPLOYMENTS), help="comma-separated: pdkv/cma, pdkv/tcp, mooncake")
    ap.add_argument("--concurrency", default="1,8,32,64", help="comma-separated --max-concurrency values")
    ap.add_argument("--prompts-per-concurrency", type=int, default=8, help="--num-prompts is this times the concurrency ...")
    ap.add_argument("--min-prompts", type=int, default=32, help="... and at least this")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens (--sharegpt-output-len, with --ignore-eos)")
    ap.add_argument("--warmup", type=int, default=64,
                    help="warm-up requests to P alone and through P/D per deployment, at the largest concurrency (0: none)")
    ap.add_argument("--seed", type=int, default=1000, help="first prompt seed; each client run takes its own")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a kv_connector_extra_config entry for pdkv's connector (JSON value)")
    ap.add_argument("--logs", help="folder for engine and client logs (default: a fresh temporary one)")
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = ap.parse_args(argv)
    deployments = [d.strip() for d in args.deployments.split(",") if d.strip()]
    for d in deployments:
        parse_deployment(d)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not concurrencies or min(concurrencies) < 1:
        raise SystemExit("--concurrency takes positive integers")
    if args.input_len + args.output_len > 1024:
        raise SystemExit("--input-len + --output-len must fit max_model_len 1024")
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="pdkv-load-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from pdkv.tinymodel import write_tiny_model

        model = str(write_tiny_model(logs / "tiny"))
    extra = {k: json.loads(v) for k, _, v in (kv.partition("=") for kv in args.set)}
    # `timeout` sends SIGTERM: exit through the finally blocks, which stop the engines' process groups.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    prompts = PromptSource(model)
    results = []
    for i, dep in enumerate(deployments):
        args_i = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * i})
        results.append(run_deployment(dep, model, concurrencies, args_i, logs, extra, prompts))
    report = {
        "command": [sys.executable, *sys.argv] if argv is None else ["load.py", *argv],
        "workload": {
            "prompts": "uniformly random tokens, first blocks distinct", "input_len": args.input_len, "output_len": args.output_len,
            "ignore_eos": True,
            "num_prompts": {c: max(args.min_prompts, args.prompts_per_concurrency * c) for c in concurrencies},
            "block_size": 32, "max_model_len": 1024, "prefix_caching": "vLLM default (on)",
        },
        "results": results,
        "wall_s": round(time.time() - started, 1),
        "logs": str(logs),
    }
    (logs / "load.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"vLLM's benchmark client, {args.input_len} random tokens in / {args.output_len} out, ignore_eos; "
          f"P/D through pdkv's proxy, P alone at P's URL; {report['wall_s']} s; logs in {logs}")
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Side-by-side benchmark of P/D proxies on stub backends, all on this machine.

Stubs (stubs.py): P answers after 5 ms; D streams 8 SSE chunks 1 ms apart.
Targets, each with its own fresh stubs:
  direct         the load generator straight to D (the floor)
  example        a re-implementation of vLLM's example Mooncake proxy (example_proxy.py)
  vllm-router    `vllm-router --vllm-pd-disaggregation --kv-connector mooncake` (pip install vllm-router)
  pdkv           pdkv's proxy
  aiohttp+httpx, aiohttp+aiohttp   pdkv's request path on aiohttp's server with either client
For each: TTFB p50/p99 at concurrency 1, 32, 128, requests/s, and the proxy's
CPU ms per request (psutil, user+system of its process tree over the run).
It also prints what each proxy's prefill request carried (captured at stub P).

Run: python benchmarks/proxy/run.py [--duration 3] [--only pdkv,vllm-router] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
PY = sys.executable
CONCURRENCY = (1, 32, 128)
TARGETS = ("direct", "example", "vllm-router", "pdkv", "aiohttp+httpx", "aiohttp+aiohttp")
PDKV_LAUNCH = (
    "import sys, logging; logging.disable(logging.INFO)\n"
    "from pdkv.proxy.config import build_config\n"
    "from pdkv.proxy.server import serve\n"
    "serve(build_config([sys.argv[1]], [sys.argv[2]], port=int(sys.argv[3])))\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 60.0) -> None:
    """Until one streaming completion through `url` answers 200."""
    body = json.dumps({"model": "stub", "prompt": "x", "max_tokens": 8, "stream": True}).encode()
    end = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                r.read()
                if r.status == 200:
                    return
        except Exception as exc:  # noqa: BLE001 - still starting
            last = exc
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout:.0f} s: {last}")


def cpu_seconds(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def proxy_command(target: str, port: int, p_url: str, b_port: int, d_url: str) -> list[str] | None:
    b_url = f"http://127.0.0.1:{b_port}"
    if target == "example":
        return [PY, str(HERE / "example_proxy.py"), "--port", str(port), "--prefill", p_url, str(b_port), "--decode", d_url]
    if target == "vllm-router":
        exe = shutil.which("vllm-router")
        if exe is None:
            return None
        return [exe, "--vllm-pd-disaggregation", "--kv-connector", "mooncake", "--policy", "round_robin",
                "--prefill", p_url, str(b_port), "--decode", d_url, "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning"]
    if target == "pdkv":
        return [PY, "-c", PDKV_LAUNCH, f"{p_url},{b_url}", d_url, str(port)]
    if target.startswith("aiohttp+"):
        return [PY, str(HERE / "client_variants.py"), "--client", target.split("+")[1], "--port", str(port),
                "--prefill", p_url, "--bootstrap", b_url, "--decode", d_url]
    raise ValueError(target)


def run_target(target: str, args: argparse.Namespace, logs: Path) -> dict:
    ports = {k: free_port() for k in ("p", "d", "b", "proxy")}
    p_url, d_url = f"http://127.0.0.1:{ports['p']}", f"http://127.0.0.1:{ports['d']}"
    stubs = start([PY, str(HERE / "stubs.py"), "--p-port", str(ports["p"]), "--d-port", str(ports["d"]),
                   "--bootstrap-port", str(ports["b"])], logs / f"stubs-{target}.log")
    proxy = None
    try:
        if target == "direct":
            url = d_url
        else:
            cmd = proxy_command(target, ports["proxy"], p_url, ports["b"], d_url)
            if cmd is None:
                return {"target": target, "skipped": "not installed"}
            proxy = start(cmd, logs / f"{target}.log")
            url = f"http://127.0.0.1:{ports['proxy']}"
        wait_ready(url)
        ps = psutil.Process(proxy.pid) if proxy else None
        levels = []
        for c in CONCURRENCY:
            before = cpu_seconds(ps) if ps else 0.0
            out = subprocess.run([PY, str(HERE / "loadgen.py"), "--url", url, "--concurrency", str(c),
                                  "--duration", str(args.duration), "--warmup", str(args.warmup)],
                                 capture_output=True, text=True, timeout=args.duration + args.warmup + 60)
            if out.returncode != 0:
                raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
            result = json.loads(out.stdout)
            if ps:
                result["cpu_ms_per_request"] = (cpu_seconds(ps) - before) * 1000 / max(1, result["all_requests"])
            levels.append(result)
        with urllib.request.urlopen(p_url + "/_stub/captured", timeout=5) as r:
            captured = json.loads(r.read())
        p_request = next((c for c in captured if c["body"].get("prompt") != "x"), captured[-1] if captured else None)
        return {"target": target, "levels": levels, "prefill_request": p_request}
    finally:
        if proxy is not None:
            stop(proxy)
        stop(stubs)


def fmt(x: float, digits: int = 2) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def table(results: list[dict]) -> str:
    lines = [
        "| proxy | c | TTFB p50 ms | TTFB p99 ms | req/s | proxy CPU ms/req | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['target']} | - | skipped: {r['skipped']} | | | | |")
            continue
        for lv in r["levels"]:
            cpu = lv.get("cpu_ms_per_request")
            lines.append(
                f"| {r['target']} | {lv['concurrency']} | {fmt(lv['ttfb_p50_ms'])} | {fmt(lv['ttfb_p99_ms'])} | "
                f"{lv['rps']:.0f} | {'-' if cpu is None else fmt(cpu, 3)} | {lv['errors']} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=3.0, help="measured seconds per concurrency level")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--only", default="", help="comma-separated targets (default: all)")
    ap.add_argument("--json", dest="json_path", default="", help="also write the raw results here")
    ap.add_argument("--logs", default="/tmp/pdkv-proxy-bench", help="directory for the processes' logs")
    args = ap.parse_args()
    targets = [t for t in TARGETS if not args.only or t in args.only.split(",")]
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    for target in targets:
        print(f"-- {target}", file=sys.stderr, flush=True)
        results.append(run_target(target, args, logs))
    print(table(results))
    print()
    for r in results:
        if r.get("prefill_request") and r["target"] != "direct":
            body = r["prefill_request"]["body"]
            keys = ("max_tokens", "min_tokens", "stream", "stop", "stop_token_ids", "kv_transfer_params")
            shown = {k: body.get(k, "(absent)") for k in keys}
            print(f"{r['target']} P request: {json.dumps(shown)}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

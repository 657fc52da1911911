"""CPU that a prefill engine burns while it holds finished requests' blocks for D and has nothing to compute.

vLLM keeps stepping an engine whose finished requests wait on their connector (P holding blocks until D
pulls), each step a round trip to every TP rank. This starts one P (pdkv's connector, tiny model, bound to
`--cores`), once per `--hold-wait-ms` value (kv_connector_extra_config `hold_wait_ms`), and measures the
CPU seconds per wall second of every process of that engine: idle with nothing held, then while it holds
`--requests` one-token prefills whose KV no D ever pulls (their blocks stay until expiry_s).

    flock /tmp/pdkv-e2e.lock python3 benchmarks/held_blocks_cpu.py --tp 2 --cores 0-1 --hold-wait-ms 0,20
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from pdkv.deploy.plan.engine import EngineSpec, engine_launch
from pdkv.deploy.run.process import ManagedProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_per_s(pid: int, seconds: float) -> float:
    """CPU seconds (user + system) per wall second of `pid` and its descendants over `seconds`."""
    def total() -> float:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        out = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                out += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return out

    c0, t0 = total(), time.monotonic()
    time.sleep(seconds)
    return (total() - c0) / (time.monotonic() - t0)


def kv_usage(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def measure(model: str, tp: int, cores: str, hold_wait_ms: float, requests: int, seconds: float, logs: Path) -> dict:
    spec = EngineSpec(
        model=model, host="127.0.0.1", port=free_port(), role="prefill", transport="tcp", platform="cpu", tp=tp,
        block_size=32, max_model_len=1024, host_ip="127.0.0.1", bootstrap_port=free_port(), omp_bind=cores,
        connector_extra={"hold_wait_ms": hold_wait_ms, "expiry_s": 600.0},
    )
    engine = ManagedProcess(engine_launch(spec, name=f"p-hold-{hold_wait_ms:g}"), logs / f"p-hold-{hold_wait_ms:g}.log")
    engine.start()
    try:
        engine.wait_healthy(300)
        time.sleep(3)  # the start-up's last work settles
        assert engine.proc is not None
        idle = cpu_per_s(engine.proc.pid, seconds)
        with httpx.Client(timeout=120) as http:
            for i in range(requests):
                body = {"model": model, "prompt": f"held request {i} " * 40, "max_tokens": 1, "temperature": 0,
                        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                               "transfer_id": f"xfer-held-{i}-{time.time_ns()}"}}
                http.post(f"{engine.url}/v1/completions", json=body).raise_for_status()
        usage = kv_usage(engine.url)
        holding = cpu_per_s(engine.proc.pid, seconds)
        return {"hold_wait_ms": hold_wait_ms, "tp": tp, "cores": cores, "idle_cpu_per_s": round(idle, 3),
                "holding_cpu_per_s": round(holding, 3), "kv_usage_while_holding": usage}
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: a fresh `pdkv model tiny`)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cores", default="0-1", help="the engine's omp_bind")
    ap.add_argument("--hold-wait-ms", default="0,20", help="comma-separated hold_wait_ms values, one engine each")
    ap.add_argument("--requests", type=int, default=4, help="one-token prefills whose blocks P then holds")
    ap.add_argument("--seconds", type=float, default=10.0, help="each measurement's length")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pdkv-held-cpu-"))
    model = args.model
    if model is None:
        from pdkv.tinymodel import write_tiny_model

        model = str(write_tiny_model(work / "tiny"))
    results = [measure(model, args.tp, args.cores, float(v), args.requests, args.seconds, work) for v in args.hold_wait_ms.split(",")]
    print(json.dumps({"results": results, "logs": str(work)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

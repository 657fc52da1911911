"""The GPU tier's deployments: 1P1D on GPU 0 (P and D share it), started by `pdkv up -f` from files written here.

Four deployments, one per connector/transport a GPU user would pick: pdkv's connector over CUDA IPC (`pdkv-ipc`),
over its own TCP connections (`pdkv-socket`, what hosts without RDMA use) and over Mooncake tcp (`pdkv-tcp`), and
vLLM's MooncakeConnector over Mooncake tcp (`mooncake-tcp`); and `pdkv-socket-layers`, `pdkv-socket` with P writing
its KV a group of layers at a time as its forward computes them (`socket_write_layers`, the connector's default on
a GPU), to measure beside `pdkv-socket`'s one write after the forward (`socket_write_layers = false`). One H200
holds three at once (six engines of Qwen3-8B): `ACTIVE`, from PDKV_GPU_DEPLOYMENTS (scripts/gpu/run.sh sets it
from DEPLOYMENTS), else `pdkv-ipc pdkv-tcp mooncake-tcp`; `pdkv-socket` and
`pdkv-socket-layers` run when named there. Each file says how its two engines share the GPU: a fixed KV cache size
(`--kv-cache-memory-bytes`, so an engine's start does not read the other's allocations as its own), CUDA graphs
of whole decode steps without torch.compile (or, with PDKV_GPU_GRAPHS=eager, eager mode),
FlashAttention, each prompt in one forward (no chunked prefill), and `VLLM_BATCH_INVARIANT=1`, so that P alone
and P/D give the same greedy tokens.

`python -m tests.gpu.deployments MODEL DIR` writes the files; `scripts/gpu/run.sh` starts them before the tests
(naming them in PDKV_GPU_UP, so the tests attach) and the benchmark; without PDKV_GPU_UP the tests start them.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("pdkv-ipc", "pdkv-tcp", "mooncake-tcp", "pdkv-socket", "pdkv-socket-layers")
DEFAULT_ACTIVE = ("pdkv-ipc", "pdkv-tcp", "mooncake-tcp")


def active(text: str | None = None) -> tuple[str, ...]:
    """The deployments started and tested: PDKV_GPU_DEPLOYMENTS (names, space or comma separated), else DEFAULT_ACTIVE."""
    text = os.environ.get("PDKV_GPU_DEPLOYMENTS", "") if text is None else text
    names = tuple(n for n in text.replace(",", " ").split() if n)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"PDKV_GPU_DEPLOYMENTS names {unknown}; known: {', '.join(NAMES)}")
    return names or DEFAULT_ACTIVE


ACTIVE = active()
READY_TIMEOUT_S = float(os.environ.get("PDKV_GPU_READY_TIMEOUT", "540"))
# Per engine under "fixed" (PDKV_GPU_KV_GIB, 4 by default: 29k tokens of Qwen3-8B's KV; six engines of 15.3 GiB of
# weights each fit one H200; four engines on an 80 GB H100 come to about 75 GB at 2: an estimate, not run).
KV_CACHE_BYTES = int(float(os.environ.get("PDKV_GPU_KV_GIB", "4")) * (1 << 30))
MAX_BATCH_TOKENS = 4096  # P's and D's tokens a forward (vLLM's --max-num-batched-tokens); the planner check's simulator too
BLOCK_SIZE = 16
# How the engines run their forwards: "full-decode" (the default): every step of decodes only replays a CUDA graph
# of the whole model (vLLM's FULL_DECODE_ONLY; the mixed steps, prefills, run eager), with no torch.compile, so six
# engines start within 2-3 minutes on one H200 (D's one-token forward 24-28 ms, against 67 ms eager); or "eager".
GRAPHS = os.environ.get("PDKV_GPU_GRAPHS", "full-decode")
# D's scheduling: "async" (the default: vLLM 0.26's async scheduling, which hands a step's output to the
# scheduler one step late) or "sync" (`--no-async-scheduling` on D: a concluded pull is scheduled one idle
# step sooner, a decode step does not overlap the next one's scheduling). P's stays vLLM's default.
DECODE_SCHEDULING = os.environ.get("PDKV_GPU_DECODE_SCHEDULING", "async")
# How each engine's KV cache is sized: "fixed" (the default: --kv-cache-memory-bytes KV_CACHE_BYTES) or, for vLLM
# 0.34's extensible KV cache (which a fixed size turns off), "extensible": a share of the GPU each
# (--gpu-memory-utilization KV_SHARE), the cache committed after warm-up from what that share leaves.
KV_SIZING = os.environ.get("PDKV_GPU_KV", "fixed")
# Each engine's share of the GPU under "extensible" (PDKV_GPU_KV_SHARE): 6 x 0.15 x 141 GiB (an H200) leaves each
# engine its 15.3 GiB of weights and a few GiB of KV; four engines on an 80 GB H100 fit at 0.22.
KV_SHARE = float(os.environ.get("PDKV_GPU_KV_SHARE", "0.15"))
# The socket deployments' settings (docs/socket.md), where a GPU host's measurement (run.sh's SOCKET_CONNECTIONS and
# SOCKET_BUFFERS sweep) says other than the transport's defaults: P's connections to D, each connection's buffers.
SOCKET_CONNECTIONS = int(os.environ.get("PDKV_GPU_SOCKET_CONNECTIONS", "0"))
SOCKET_BUFFER = os.environ.get("PDKV_GPU_SOCKET_BUFFER", "")  # bytes; "": the transport's default
# pdkv-socket-layers: the writes P's forward's layers are cut into (socket_layer_groups); "": the connector's default.
SOCKET_LAYER_GROUPS = os.environ.get("PDKV_GPU_SOCKET_LAYER_GROUPS", "")
# The socket deployments' P: "false" writes from P's own threads (socket_send_process); "": the connector's default
# (a send process of its own, on a GPU).
SOCKET_SEND_PROCESS = os.environ.get("PDKV_GPU_SOCKET_SEND_PROCESS", "")
GRAPH_ARGS = {
    "eager": ["--enforce-eager"],
    "full-decode": ["--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})],
}


@dataclass(frozen=True)
class Ports:
    proxy: int
    prefill: int
    decode: int
    bootstrap: int
    kv_events: int


PORTS = {
    "pdkv-ipc": Ports(8000, 8100, 8200, 9000, 5600),
    "pdkv-tcp": Ports(8001, 8101, 8201, 9010, 5620),
    "mooncake-tcp": Ports(8002, 8102, 8202, 9020, 5640),
    "pdkv-socket": Ports(8003, 8103, 8203, 9030, 5660),
    "pdkv-socket-layers": Ports(8004, 8104, 8204, 9040, 5680),
}


def deployment_toml(name: str, model: str, graphs: str = GRAPHS) -> str:
    if DECODE_SCHEDULING not in ("async", "sync"):
        raise ValueError(f"PDKV_GPU_DECODE_SCHEDULING must be async or sync, got {DECODE_SCHEDULING!r}")
    if KV_SIZING not in ("fixed", "extensible"):
        raise ValueError(f"PDKV_GPU_KV must be fixed or extensible, got {KV_SIZING!r}")
    sizing = (["--gpu-memory-utilization", "0.12", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)] if KV_SIZING == "fixed"
              else ["--gpu-memory-utilization", str(KV_SHARE)])
    connector, transport, *mode = name.split("-")
    connector = "pdkv" if connector == "pdkv" else "mooncake"
    # pdkv-socket-layers: P writes its KV a group of layers at a time as its forward computes them (what the connector
    # does by default on a GPU); pdkv-socket: one write after the forward. The one difference between the two.
    layers = ""
    if transport == "socket":
        layers = f"socket_write_layers = {'true' if mode == ['layers'] else 'false'}\n"
        layers += f"socket_layer_groups = {int(SOCKET_LAYER_GROUPS)}\n" if mode == ["layers"] and SOCKET_LAYER_GROUPS else ""
        layers += f"socket_connections = {SOCKET_CONNECTIONS}\n"
        layers += f"socket_buffer_bytes = {int(SOCKET_BUFFER)}\n" if SOCKET_BUFFER else ""
        layers += f"socket_send_process = {SOCKET_SEND_PROCESS}\n" if SOCKET_SEND_PROCESS in ("true", "false") else ""
    p = PORTS[name]
    args = [
        *GRAPH_ARGS[graphs], "--attention-backend", "FLASH_ATTN", *sizing, "--max-num-seqs", "32",
        # Each prompt in one forward whatever the load: P's KV of a prompt cut into chunks differs in the last
        # bits from P alone's, and under 16 requests in flight a greedy tie then fell the other way.
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(MAX_BATCH_TOKENS),
    ]
    engine_args = json.dumps(args)
    decode_args = json.dumps(args + (["--no-async-scheduling"] if DECODE_SCHEDULING == "sync" else []))
    env = '{ VLLM_BATCH_INVARIANT = "1", VLLM_USE_FLASHINFER_SAMPLER = "0" }'
    # vLLM 0.26's MooncakeConnector has no bootstrap_server_address: its P serves the registry itself.
    bootstrap = "standalone" if connector == "pdkv" else "in-worker"
    return f"""# {name}: 1P1D on GPU 0, both engines on the one GPU (KV cache {KV_SIZING}), KV over {transport}, {graphs},
# D's scheduling {DECODE_SCHEDULING}{", P writing layer by layer" if layers else ""}.
model = "{model}"
served_model_name = "qwen3-8b-random"
connector = "{connector}"
transport = "{transport}"
platform = "gpu"
host = "127.0.0.1"
host_ip = "127.0.0.1"
block_size = {BLOCK_SIZE}
max_model_len = 4096
startup_timeout = {READY_TIMEOUT_S:.0f}
restart = "on-failure"
kv_events_port = {p.kv_events}
{layers}
[bootstrap]
mode = "{bootstrap}"
port = {p.bootstrap}

[[prefill]]
gpu = "0"
port = {p.prefill}
extra_args = {engine_args}
env = {env}

[[decode]]
gpu = "0"
port = {p.decode}
extra_args = {decode_args}
env = {env}

[proxy]
port = {p.proxy}
"""


def write_files(model: str, directory: Path) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in NAMES:
        out[name] = directory / f"{name}.toml"
        out[name].write_text(deployment_toml(name, model))
    return out


@dataclass
class Running:
    """One deployment as the tests see it: its URLs, and (when these tests started it) its `pdkv up` process."""

    name: str
    proxy: str
    prefill: str
    decode: str
    log_dir: Path | None = None
    proc: subprocess.Popen[str] | None = None


def urls(name: str) -> Running:
    p = PORTS[name]
    return Running(name, f"http://127.0.0.1:{p.proxy}", f"http://127.0.0.1:{p.prefill}", f"http://127.0.0.1:{p.decode}")


def start(name: str, file: Path, log: Path) -> Running:
    """`pdkv up -f FILE --json` in its own process group, its parts' logs beside `log`; returns once started."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdkv", "up", "-f", str(file), "--json", "--log-dir", str(log.parent / f"logs-{name}")],
        cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=log.open("w"), start_new_session=True,
    )
    run = urls(name)
    run.proc = proc
    return run


def wait_ready(runs: list[Running], timeout: float = READY_TIMEOUT_S) -> None:
    """Until every started deployment's `pdkv up` says ready; raise naming the first that ended or ran late."""
    events: queue.Queue = queue.Queue()

    def read(run: Running) -> None:
        assert run.proc is not None and run.proc.stdout is not None
        for line in run.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                events.put((run, json.loads(line)))
        events.put((run, None))

    waiting = {r.name for r in runs if r.proc is not None}
    for r in runs:
        if r.proc is not None:
            threading.Thread(target=read, args=(r,), daemon=True).start()
    deadline = time.monotonic() + timeout
    while waiting:
        try:
            run, event = events.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"pdkv up of {sorted(waiting)} not ready within {timeout:.0f} s") from None
        if event is None:
            raise AssertionError(f"pdkv up of {run.name} ended before it was ready (exit {run.proc.wait()})")
        if event.get("event") == "starting":
            run.log_dir = Path(event["log_dir"])
        elif event.get("event") == "ready":
            waiting.discard(run.name)


def attach(name: str) -> Running:
    """A deployment someone else started (scripts/gpu/run.sh): its URLs once its proxy answers /health."""
    run = urls(name)
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{run.proxy}/health", timeout=2, trust_env=False).status_code == 200:
                return run
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}'s proxy {run.proxy} is not healthy")
        time.sleep(0.5)


def stop(run: Running, grace: float = 60.0) -> None:
    """Ctrl-C to `pdkv up` (it stops every part), then SIGKILL to its group after `grace` seconds."""
    if run.proc is None or run.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGINT)
    try:
        run.proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait(10)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.gpu.deployments MODEL_DIR OUT_DIR")
    for name, path in write_files(sys.argv[1], Path(sys.argv[2])).items():
        print(name, path)

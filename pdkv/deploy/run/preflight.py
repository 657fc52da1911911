"""Pre-flight: every reason a deployment would fail to start, found before any part starts.

Each problem names the part, what is wrong and the fix; `raise_problems`
turns them into one PreflightError, one problem per line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from pdkv.deploy.plan import CPU_BLOCK_MULTIPLE, Part, PortUse, distinct_per_host, numa_nodes, parse_cores
from pdkv.deploy.run.stages import gpus_of, share_gpu
from pdkv.errors import ConfigError, RemoteError, TransferError, UnreachableError
from pdkv.tp_heads import rank_heads

SHIM_FOLDER = "cpu_accelerator"  # tests/shims/cpu_accelerator: a test-only fake accelerator index for vLLM's connector


class Problem(msgspec.Struct, frozen=True):
    """One pre-flight failure: which part, what is wrong, what to do about it."""

    part: str
    what: str
    fix: str

    def line(self) -> str:
        return f"{self.part}: {self.what}; fix: {self.fix}"


def port_free(host: str, port: int) -> bool:
    """True when a server could listen on host:port now (binds and releases it; sends nothing)."""
    import socket

    bind_host = "" if host in ("0.0.0.0", "*") else host
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers themselves bind
        try:
            s.bind((bind_host, port))
        except OSError:
            return False
    return True


def check_ports(parts: list[Part], reserved: Sequence[PortUse] = ()) -> list[Problem]:
    """Every port of `parts` and the `reserved` ones (the engines `[autoscale]` may add) distinct on each host and
    free now; each problem names the part, what binds the port and the setting it comes from."""
    uses = [u for p in parts for u in p.ports] + list(reserved)
    twice = list(distinct_per_host(uses))
    problems = [Problem(u.part, f"port {u.port} ({u.what}, from {u.setting}) is also {first.part}'s {first.what} (from {first.setting})",
                        f"give each its own port: change {u.setting} or {first.setting}")
                for u, first in twice]
    repeated = {id(u) for u, _ in twice}
    for u in uses:
        if id(u) not in repeated and not port_free(u.bind, u.port):
            added = " (an engine [autoscale] may add)" if any(u is r for r in reserved) else ""
            problems.append(Problem(
                f"{u.part}{added}",
                f"port {u.port} on {u.bind} ({u.what}, from {u.setting}) is held by another process",
                f"stop what holds it (ss -ltnp 'sport = :{u.port}') or change {u.setting}",
            ))
    return problems


def _canonical_dtype(dtype: str | None) -> str:
    from pdkv.geometry import DTYPE_BYTES

    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    d = (dtype or "auto").lower()
    return aliases.get(d, d) if d == "auto" or d in DTYPE_BYTES else d


def _engine_facts(part: Part) -> tuple[dict[str, Any] | None, Problem | None]:
    """The model config of an engine part, or the problem reading it (None, None for a hub id)."""
    from pdkv.geometry import load_config

    assert part.spec is not None
    model = part.spec.model
    path = Path(model).expanduser()
    if not path.exists():
        if "/" in model and not model.startswith((".", "/", "~")) and model.count("/") == 1:
            return None, None  # a hub id: vLLM resolves it; nothing local to read
        return None, Problem(
            part.launch.name, f"model {model} does not exist", "pass a model directory holding config.json (or `pdkv model tiny DIR`)"
        )
    try:
        return load_config(path), None
    except ConfigError as exc:
        return None, Problem(
            part.launch.name, f"model config unreadable: {exc.message}", exc.hint or "fix or replace the model's config.json"
        )


def cpu_accelerator_shim(part: Part, environ: Mapping[str, str] | None = None) -> bool:
    """True when the engine's PYTHONPATH (its own env, else the caller's) has a folder named
    `cpu_accelerator` holding a `sitecustomize.py`: the test-only shim (tests/shims/cpu_accelerator)
    under which vLLM's MooncakeConnector does run on CPU, as the e2e tests and the handover benchmark run it."""
    env = os.environ if environ is None else environ
    path = part.launch.env.get("PYTHONPATH", env.get("PYTHONPATH", ""))
    return any(
        Path(entry).name == SHIM_FOLDER and (Path(entry) / "sitecustomize.py").is_file() for entry in path.split(os.pathsep) if entry
    )


def check_connector(parts: list[Part], environ: Mapping[str, str] | None = None) -> list[Problem]:
    """vLLM's MooncakeConnector on a CPU engine, without the shim: one problem naming every such engine."""
    names = [p.launch.name for p in parts if p.spec is not None and p.spec.connector == "mooncake" and p.spec.platform == "cpu"
             and p.spec.role != "none" and not cpu_accelerator_shim(p, environ)]
    if not names:
        return []
    return [Problem(
        ", ".join(names),
        "vLLM's MooncakeConnector needs GPU KV caches; on a CPU host the engine dies with "
        "\"Cannot access accelerator device when none is available\"",
        "use --connector pdkv (connector = \"pdkv\" in deploy.toml)",
    )]


def check_vllm_release(parts: list[Part]) -> list[Problem]:
    """The vLLM this host would start engines with, outside the range pdkv's connector supports: one problem."""
    from pdkv.doctor import Status, installed_vllm_verdict

    names = [p.launch.name for p in parts if p.spec is not None and p.spec.connector == "pdkv" and p.spec.role != "none"]
    if not names:
        return []
    verdict = installed_vllm_verdict()
    return [Problem(", ".join(names), verdict.detail, verdict.hint)] if verdict.status is Status.FAIL else []


def _rank_core_hint(tp: int) -> str:
    """An omp_bind value giving `tp` ranks this host's cores in even runs ("0|1", "0-1|2-3")."""
    per = max(1, (os.cpu_count() or 1) // tp)
    return "|".join(f"{r * per}" if per == 1 else f"{r * per}-{(r + 1) * per - 1}" for r in range(tp))


def _missing_cores(bind: str | None) -> list[int]:

    return [c for c in parse_cores(bind) or () if c >= (os.cpu_count() or 1)]


def check_engines(parts: list[Part]) -> list[Problem]:
    """Model configs readable, CPU block sizes valid, and every D agrees with every P."""
    problems: list[Problem] = []
    engines = [p for p in parts if p.spec is not None]
    configs: dict[str, dict[str, Any] | None] = {}
    for part in engines:
        config, problem = _engine_facts(part)
        configs[part.launch.name] = config
        if problem:
            problems.append(problem)
        spec = part.spec
        assert spec is not None
        if spec.platform == "cpu" and spec.block_size is not None and spec.block_size % CPU_BLOCK_MULTIPLE:
            problems.append(Problem(
                part.launch.name,
                f"block size {spec.block_size} is not a multiple of {CPU_BLOCK_MULTIPLE}, which vLLM's CPU attention needs",
                f"set block_size = {CPU_BLOCK_MULTIPLE}",
            ))
        if spec.platform == "cpu" and (missing := _missing_cores(spec.omp_bind)):
            problems.append(Problem(
                part.launch.name,
                f"omp_bind {spec.omp_bind!r} names core(s) {', '.join(map(str, missing))}, and this host has {os.cpu_count()} cores",
                f"bind its {spec.tp} rank(s) to cores 0-{(os.cpu_count() or 1) - 1}, one core at least each",
            ))
        if spec.platform == "cpu" and spec.tp > 1 and parse_cores(spec.omp_bind) is None and (nodes := numa_nodes()) < spec.tp:
            # vLLM's CPU worker binds each rank to a NUMA node of its own unless told the cores, and dies inside its start-up
            # ("Not enough allowed NUMA nodes to bind threads of N local CPUWorkers") when the host has fewer.
            problems.append(Problem(
                part.launch.name,
                f"tp {spec.tp} on CPU without omp_bind: vLLM binds each rank to a NUMA node of its own, and this host has {nodes}",
                f'set omp_bind = "{_rank_core_hint(spec.tp)}" in its table (one core or more per rank, cores no other engine is bound to)',
            ))
        if spec.transport == "cma" and spec.platform != "cpu":
            problems.append(Problem(
                part.launch.name,
                "transport cma moves KV in host memory, and this engine keeps it on a GPU",
                "use transport = \"ipc\" between GPUs of one host, else tcp or rdma",
            ))
    for d in (p for p in engines if p.kind == "decode"):
        for p in (p for p in engines if p.kind == "prefill"):
            problems += pd_disagreements(p, d, configs.get(p.launch.name), configs.get(d.launch.name))
    return problems


def pd_disagreements(p: Part, d: Part, p_config: dict[str, Any] | None, d_config: dict[str, Any] | None) -> list[Problem]:
    ps, ds = p.spec, d.spec
    assert ps is not None and ds is not None
    pair = f"{p.launch.name}/{d.launch.name}"
    out: list[Problem] = []
    same_model = Path(ps.model).expanduser().resolve() == Path(ds.model).expanduser().resolve() or ps.model == ds.model
    if not same_model and (p_config is None or d_config is None or p_config != d_config):
        out.append(Problem(
            pair,
            f"P serves {ps.model} but D serves {ds.model}",
            "serve the same model on both (model = ... in deploy.toml)",
        ))
    p_dtype = _canonical_dtype(ps.dtype if ps.dtype not in (None, "auto") else (p_config or {}).get("torch_dtype"))
    d_dtype = _canonical_dtype(ds.dtype if ds.dtype not in (None, "auto") else (d_config or {}).get("torch_dtype"))
    if p_dtype != d_dtype:
        out.append(Problem(
            pair,
            f"P's dtype {p_dtype} differs from D's {d_dtype}: the KV bytes would not match",
            "set the same dtype on both",
        ))
    if ps.block_size != ds.block_size:
        def show(b: int | None) -> str:
            return "vLLM's default" if b is None else str(b)

        out.append(Problem(
            pair,
            f"block size differs: P {show(ps.block_size)}, D {show(ds.block_size)}",
            "set the same block_size on both",
        ))
    if max(ps.tp, ds.tp) % min(ps.tp, ds.tp):
        out.append(Problem(
            pair,
            f"TP sizes {ps.tp} (P) and {ds.tp} (D) do not divide each other, so KV heads cannot be mapped",
            "use TP sizes where one divides the other",
        ))
    elif ps.connector == "pdkv" and ds.connector == "pdkv" and ps.tp != ds.tp:
        out += _head_split(pair, ps.tp, ds.tp, p_config)
    return out


def _head_split(pair: str, p_tp: int, d_tp: int, config: dict[str, Any] | None) -> list[Problem]:
    """P and D of different TP sizes with pdkv's connector: the model's KV heads must split over both sizes."""

    if config is None:
        return []  # a hub id: the engines check it when D first pulls
    if config.get("kv_lora_rank"):
        return [Problem(pair, f"TP sizes differ (P {p_tp}, D {d_tp}) on an MLA model, which pdkv's connector does not move",
                        "use connector = \"mooncake\" (vLLM's connector) for MLA models")]
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        return []  # the engines say what is wrong with the config
    for tp in (p_tp, d_tp):
        try:
            rank_heads(heads, tp, 0)
        except TransferError as exc:
            return [Problem(pair, f"{exc}, so P (TP {p_tp}) and D (TP {d_tp}) cannot split them", "use TP sizes that split the KV heads")]
    return []


def check_bootstraps(urls: list[str], timeout: float = 2.0) -> list[Problem]:
    """Each external bootstrap answers GET /query within `timeout`."""
    from pdkv.bootstrap import BootstrapClient

    problems = []
    for url in urls:
        client = BootstrapClient(url, timeout=timeout, retries=0)
        try:
            with client:
                client.query()
        except RemoteError as exc:
            problems.append(Problem(
                "bootstrap",
                f"{client.url} answered {exc.status if exc.status is not None else 'something else'} to GET /query",
                "point at a Mooncake bootstrap server (pdkv bootstrap)",
            ))
        except UnreachableError as exc:
            problems.append(Problem(
                "bootstrap",
                f"{client.url} is unreachable ({exc.message})",
                "start it (pdkv bootstrap --port PORT) or fix the bootstrap URL",
            ))
    return problems


def check_cma(parts: list[Part], proc_root: str = "/proc", timeout: float = 5.0) -> list[Problem]:
    """With transport cma, one live probe that a process of this host may write into another's memory."""
    if not any(p.spec is not None and p.spec.transport == "cma" and p.spec.platform == "cpu" for p in parts):
        return []
    from pdkv.doctor import cma_verdict
    from pdkv.transport import ptrace_scope

    ok, detail, fix = cma_verdict(ptrace_scope(proc_root), timeout)
    return [] if ok else [Problem("cma", detail, fix)]


def _memory_share(part: Part) -> float | None:
    """The `--gpu-memory-utilization` an engine's arguments give, None where they give none."""
    args = list(part.spec.extra_args) if part.spec else []
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name == "--gpu-memory-utilization":
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            try:
                return float(value)
            except ValueError:
                return None
    return None


def check_gpu_shares(parts: list[Part]) -> list[Problem]:
    """Engines that share a GPU must each be given a share of its memory, together at most all of it: vLLM's default
    (0.92 of the GPU; all of it with vLLM 0.34's extensible KV cache) lets only the first start."""
    engines = [p for p in parts if p.kind in ("prefill", "decode")]
    problems: list[Problem] = []
    for i, a in enumerate(engines):
        group = [a, *(b for b in engines[i + 1:] if share_gpu(a, b))]
        unset = [p.launch.name for p in group if _memory_share(p) is None]
        if len(group) > 1 and unset:
            problems.append(Problem(
                ", ".join(p.launch.name for p in group),
                f"share a GPU, and {', '.join(unset)} take{'s' if len(unset) == 1 else ''} vLLM's default share of its memory "
                "(0.92; all of it with vLLM 0.34's extensible KV cache): only the engine that starts first fits",
                "give each engine on that GPU --gpu-memory-utilization in extra_args, together at most 1"))
            break
    by_gpu: dict[tuple[str | None, str], list[Part]] = {}
    for p in engines:
        for gpu in sorted(gpus_of(p) or ()):
            by_gpu.setdefault((p.host, gpu), []).append(p)
    for (_, gpu), on in by_gpu.items():
        shares = [_memory_share(p) for p in on]
        if len(on) > 1 and all(s is not None for s in shares) and sum(shares) > 1.0:  # type: ignore[arg-type]
            problems.append(Problem(
                ", ".join(p.launch.name for p in on),
                f"share GPU {gpu} with --gpu-memory-utilization adding up to {sum(shares):.2f}",  # type: ignore[arg-type]
                "lower each engine's --gpu-memory-utilization so that together they are at most 1"))
    return problems


def preflight(parts: list[Part], bootstrap_urls: Sequence[str] = (), *, reserved: Sequence[PortUse] = ()) -> list[Problem]:
    """Every pre-flight problem of `parts` (and of the `reserved` ports of engines `[autoscale]` may add), in start
    order; empty when all is well."""
    return (check_ports(parts, reserved) + check_connector(parts) + check_vllm_release(parts) + check_engines(parts)
            + check_gpu_shares(parts) + check_cma(parts) + check_bootstraps(list(bootstrap_urls)))


def shared_cores(parts: list[Part]) -> list[str]:
    """One line per CPU engine whose cores (omp_bind) another engine of this host binds too: more TP ranks than
    cores. Each engine still runs, but the forwards of the ranks sharing a core take turns on it."""

    owner: dict[int, str] = {}
    out: list[str] = []
    for part in parts:
        if part.spec is None or part.spec.platform != "cpu":
            continue
        cores = parse_cores(part.spec.omp_bind) or []
        if shared := sorted({c for c in cores if c in owner}):
            ranks = sum(p.spec.tp for p in parts if p.spec is not None and p.spec.platform == "cpu")
            out.append(f"{part.launch.name} shares core(s) {', '.join(map(str, shared))} with {owner[shared[0]]}: this host has "
                       f"{os.cpu_count()} cores for {ranks} engine ranks, so their forwards take turns on them")
        for c in cores:
            owner.setdefault(c, part.launch.name)
    return out


def raise_problems(problems: list[Problem]) -> None:
    """Raise one PreflightError whose message holds each problem on its own line."""
    from pdkv.errors import PreflightError

    if not problems:
        return
    if len(problems) == 1:
        raise PreflightError(f"pre-flight: {problems[0].part}: {problems[0].what}", hint=problems[0].fix)
    lines = "\n".join(f"  {p.line()}" for p in problems)
    raise PreflightError(f"pre-flight found {len(problems)} problems:\n{lines}", hint="nothing was started")

"""`pdkv up`: start one P/D role, a deploy.toml, or the built-in local 1P1D, and supervise it."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdkv.bootstrap import DEFAULT_PORT as DEFAULT_BOOTSTRAP_PORT
from pdkv.cli.options import JsonOpt
from pdkv.cli.output import console, err_console, print_json

HELP = """Start vLLM engines for P/D serving: one role, a deployment file, or a whole local 1P1D.

With no arguments, starts bootstrap, prefill, decode and proxy on this host
(on CPU with the embedded tiny model when no GPU is present), waits for each
to be healthy, streams their logs (also to .pdkv/logs/) and stops them all on
Ctrl-C. Pre-flight checks (ports, model, P/D agreement, bootstrap) run first.

Examples:

  pdkv up

  pdkv up --trace --once

  pdkv up -f deploy.toml

  pdkv up -f fleet.toml --host B

  pdkv up --role prefill --model /models/Qwen3-8B --gpu 0 --device mlx5_0

  pdkv up --role decode --model /models/Qwen3-8B --gpu 2 --port 8200 --dry-run --json

  pdkv up --role prefill --model M --bootstrap http://10.0.0.2:8998 -- --enforce-eager

  pdkv up --role decode --model M --members http://10.0.0.1:8998   # join a running deployment
"""

COLORS = {"bootstrap": "magenta", "prefill": "cyan", "decode": "green", "proxy": "yellow"}
STAGES = {"bootstrap": 0, "prefill": 1, "decode": 1, "proxy": 2}
STATE_STYLE = {"waiting": "dim", "starting": "yellow", "ready": "green", "restarting": "yellow", "failed": "red", "exited": "red",
               "stopped": "dim"}


def _command_line(env: dict[str, str], argv: list[str]) -> str:
    return shlex.join([f"{k}={v}" for k, v in env.items()] + argv)


def _part_doc(part: Any, restart: str | None) -> dict[str, Any]:
    plan = part.plan
    return {"name": plan.name, "kind": part.kind, "url": plan.url, "argv": plan.argv, "env": plan.env,
            "command": _command_line(plan.env, plan.argv), "restart": restart or part.restart}


def _status_table(sup: Any, kinds: dict[str, str]) -> Table:
    table = Table(title="pdkv up", show_header=True, expand=False)
    for col in ("part", "state", "url", "pid", "ready after"):
        table.add_column(col)
    for proc in sup.procs:
        state = sup.states[proc.name]
        ready = f"{sup.ready_s[proc.name]:.1f} s" if proc.name in sup.ready_s else ""
        table.add_row(
            Text(proc.name, style=COLORS.get(kinds[proc.name], "")),
            Text(state, style=STATE_STYLE.get(state, "")),
            proc.url,
            str(proc.pid or ""),
            ready,
        )
    return table


def _ready_message(parts: list[Any], served: str | None) -> list[Text]:
    proxy = next((p for p in parts if p.kind == "proxy"), None)
    target = proxy or next((p for p in parts if p.kind in ("prefill", "decode")), None)
    if target is None:  # a fleet host with only a bootstrap server
        return [Text("ready.", style="bold green"), Text("Ctrl-C stops every part.", style="dim")]
    model = served or (target.spec.model if target.spec else "MODEL")
    body = json.dumps({"model": model, "prompt": "The river runs north to the city", "max_tokens": 16})
    curl = f"  curl -s {target.plan.url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"
    lines = [Text("ready. Send a request:", style="bold green"), Text(curl)]
    if proxy is not None:
        lines.append(Text(f"  pdkv status --proxy {proxy.plan.url}"))
        if importlib.util.find_spec("pdkv.cli.trace") is not None:
            lines.append(Text(f"  pdkv trace --proxy {proxy.plan.url}"))
    lines.append(Text("Ctrl-C stops every part.", style="dim"))
    return lines


def _run_trace_hook(parts: list[Any], emit: Any, json_out: bool) -> None:
    """`--trace`: send one request through the ready deployment and print its timeline (`pdkv trace`)."""
    import msgspec

    from pdkv.cli.trace import render_trace
    from pdkv.trace.collect import run_trace

    proxy = next((p for p in parts if p.kind == "proxy"), None)
    if proxy is None:
        err_console.print("--trace: this deployment has no proxy to trace through")
        return
    trace = run_trace(proxy.plan.url)
    if json_out:
        emit("trace", trace=msgspec.to_builtins(trace))
    else:
        render_trace(trace)


def _served_model(parts: list[Any], served: str | None) -> str:
    if served:
        return served
    return next(p for p in parts if p.spec is not None).spec.model


def _supervise(
    parts: list[Any], *, log_dir: Path, timeout: float, json_out: bool, show_logs: bool, served: str | None, trace: bool,
    once: bool = False, restart: str | None = None,
) -> None:
    from pdkv.deploy import PartEvent, RestartPolicy, Supervisor
    from pdkv.deploy.warmup import WARMUP_TIMEOUT_S, warm_up_deployment
    from pdkv.errors import PdkvError

    kinds = {p.plan.name: p.kind for p in parts}
    width = max(len(n) for n in kinds)
    live: Live | None = None

    def on_line(name: str, line: str) -> None:
        prefix = Text(f"{name:<{width}} | ", style=COLORS.get(kinds[name], ""))
        (live.console if live else console).print(prefix + Text(line), highlight=False, soft_wrap=True)

    def emit(event: str, **fields: Any) -> None:
        if json_out:
            sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
            sys.stdout.flush()

    def on_event(event: PartEvent) -> None:
        if json_out:
            emit(event.kind, name=event.name, message=event.message, code=event.code, delay_s=event.delay_s, pid=event.pid)
        else:
            style = {"restarted": "green", "gave-up": "bold red"}.get(event.kind, "yellow")
            err_console.print(Text(f"pdkv up: {event.message}", style=style), highlight=False, soft_wrap=True)

    # Engines start together (each pinned to its own cores on CPU): start-up is the slow part.
    stages = [STAGES[p.kind] for p in parts]
    policies = [RestartPolicy(restart or p.restart) for p in parts]  # type: ignore[arg-type]
    restart_with: dict[str, list[str]] = {}
    for p in parts:
        if p.registers_with:
            restart_with.setdefault(p.registers_with, []).append(p.plan.name)
    sup = Supervisor([p.plan for p in parts], log_dir, on_line=on_line if show_logs and not json_out else None, stages=stages,
                     restart=policies, restart_with=restart_with, on_event=on_event)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops cleanly, like Ctrl-C
    # A shell starting `pdkv up &` hands it SIGINT ignored; Ctrl-C / kill -INT must still stop everything.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if not json_out:
            live = Live(_status_table(sup, kinds), console=console, refresh_per_second=4, transient=False)
            sup.on_change = lambda: live.update(_status_table(sup, kinds)) if live is not None else None
            live.start()
        emit("starting", parts=[{"name": p.plan.name, "url": p.plan.url} for p in parts], log_dir=str(log_dir))
        try:
            total = sup.start_all(timeout)
        finally:
            if live is not None:
                live.stop()
                live = None
        warmup_ms = warm_up_deployment(parts, _served_model(parts, served), timeout=min(timeout, WARMUP_TIMEOUT_S))
        emit("ready", ready_s=round(total, 1), warmup_ms=[round(ms, 1) for ms in warmup_ms],
             parts=[{"name": p.name, "url": p.url, "pid": p.pid, "log": str(p.log_path)} for p in sup.procs])
        if not json_out:
            warmed = f" (warm-up request{'s' * (len(warmup_ms) > 1)} {', '.join(f'{ms:.0f}' for ms in warmup_ms)} ms)" if warmup_ms else ""
            console.print(f"all {len(parts)} parts ready in {total:.1f} s{warmed}; logs in {log_dir}/")
            for line in _ready_message(parts, served):
                console.print(line, soft_wrap=True)  # the curl line must stay one pastable line
        if trace:
            _run_trace_hook(parts, emit, json_out)
        if once:
            return
        dead = sup.watch()
        assert dead is not None  # watch returns None only when asked to stop
        why = "no part is left running" if sup.states[dead.name] == "failed" else "it is not restarted"
        raise PdkvError(f"{dead.name} exited with code {dead.poll()} and {why}; stopping the rest.\n{dead.log_tail(20)}",
                        hint=f"read {dead.log_path}")
    except KeyboardInterrupt:
        if not json_out:
            err_console.print("stopping every part ...")
    finally:
        if live is not None:
            live.stop()
        # A second Ctrl-C or a SIGTERM must not cut the shutdown short and orphan an engine.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            sup.stop_all()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)
        emit("stopped", pids=sup.pids())
        if not json_out:
            err_console.print("stopped.")


def up(
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Deployment file (TOML) to start.")] = None,
    role: Annotated[str | None, typer.Option("--role", help="Start one engine: prefill or decode.")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m",
        help="Model directory or hub id (default: the embedded tiny model).")] = None,
    connector: Annotated[str, typer.Option("--connector", help="KV connector: pdkv or mooncake (vLLM's own).")] = "pdkv",
    protocol: Annotated[str | None, typer.Option("--protocol",
        help="KV transport: rdma or tcp (Mooncake); ipc (CUDA IPC between GPUs of this host; list both GPUs in --gpu, own first); cma "
        "(host memory between processes of this host, CPU). Local 1P1D on CPU: cma.")] = None,
    device: Annotated[str, typer.Option("--device", help="RDMA device name, e.g. mlx5_0.")] = "",
    gpu: Annotated[str | None, typer.Option("--gpu", help="GPU index(es) for CUDA_VISIBLE_DEVICES, e.g. 0 or 0,1.")] = None,
    port: Annotated[int | None, typer.Option("--port",
        help="Engine port with --role (8100 P, 8200 D); else the proxy port (8000).")] = None,
    host: Annotated[str | None, typer.Option("--host",
        help="With -f: the [[hosts]] name whose parts to start (default: the hosts with an address of this machine). With --role: the "
        "address the engine listens on (default 0.0.0.0).", show_default=False)] = None,
    host_ip: Annotated[str | None, typer.Option("--host-ip",
        help="Address peers reach this engine at (VLLM_HOST_IP); detected if unset.")] = None,
    bootstrap_port: Annotated[int | None, typer.Option("--bootstrap-port",
        help="Port of P's in-worker bootstrap server (VLLM_MOONCAKE_BOOTSTRAP_PORT).")] = None,
    bootstrap: Annotated[str | None, typer.Option("--bootstrap", help="URL of a standalone bootstrap server for P.")] = None,
    members: Annotated[str | None, typer.Option("--members",
        help="With --role: join the members registry of this bootstrap server (URL), so a proxy following it (pdkv proxy --members) routes"
        " to the engine.")] = None,
    block_size: Annotated[int | None, typer.Option("--block-size", help="Tokens per KV block (CPU: a multiple of 32).")] = None,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size.")] = 1,
    platform: Annotated[str | None, typer.Option("--platform", help="gpu or cpu (default: gpu when one is present).")] = None,
    omp_bind: Annotated[str | None, typer.Option("--omp-bind",
        help="CPU cores for the engine's OpenMP threads, e.g. 0 or 0-3 (CPU only).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the exact commands and environment; start nothing.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds each part may take to become healthy.")] = 900.0,
    log_dir: Annotated[Path, typer.Option("--log-dir", help="Where each part's log is written.")] = Path(".pdkv/logs"),
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Do not stream the parts' logs (they still go to --log-dir).")] = False,
    trace: Annotated[bool, typer.Option("--trace",
        help="Once ready, send one request through the proxy and print its timeline (pdkv trace).")] = False,
    once: Annotated[bool, typer.Option("--once",
        help="Stop every part once ready (and traced, with --trace) instead of serving until Ctrl-C.")] = False,
    restart: Annotated[str | None, typer.Option("--restart",
        help="When a part dies: on-failure (start it again, backoff 1 s doubling to 30 s, at most 5 restarts a minute) or no (stop every "
        "part). Overrides the deployment file's restart keys; default on-failure.", show_default=False)] = None,
    json_out: JsonOpt = False,
    extra: Annotated[list[str] | None, typer.Argument(help="Extra vLLM arguments, after --.", show_default=False)] = None,
) -> None:
    from pdkv.deploy import (deployment_parts, ensure_tiny_model, external_bootstraps, gpu_count, load_deployment, local_deployment,
                             preflight, raise_problems, shared_cores, tiny_model_path)
    from pdkv.deploy.fleet import chosen_hosts, local_addresses, select_parts
    from pdkv.deploy.single import role_parts, split_cores, with_cores, with_extra
    from pdkv.deploy.vllm_logging import with_vllm_logging, write_logging_config
    from pdkv.errors import UsageError

    for value, allowed, flag in ((connector, ("pdkv", "mooncake"), "--connector"),
                                 (protocol, ("rdma", "tcp", "ipc", "cma", None), "--protocol"),
                                 (platform, ("gpu", "cpu", None), "--platform"), (restart, ("on-failure", "no", None), "--restart")):
        if value not in allowed:
            raise UsageError(f"{flag} {value!r} is not one of {', '.join(a for a in allowed if a)}")
    if file is not None and role is not None:
        raise UsageError("give either -f FILE or --role, not both")
    if members is not None and role is None:
        raise UsageError("--members goes with --role", hint="a deployment file's engines join its first bootstrap's registry by themselves")
    if host is not None and file is None and role is None:
        raise UsageError("--host goes with -f FILE (a [[hosts]] name) or --role (a listen address)")
    gpus = gpu_count()
    if protocol == "ipc" and (platform == "cpu" or (platform is None and not gpus)):
        raise UsageError("--protocol ipc moves KV between GPUs, and no GPU is in use here", hint="use --protocol tcp or cma on CPU hosts")
    if protocol == "cma" and (platform == "gpu" or (platform is None and gpus)):
        raise UsageError("--protocol cma moves KV in host memory, and these engines keep it on a GPU",
                         hint="use --protocol ipc between GPUs of this host")
    served: str | None = None
    uses_tiny = model is None and file is None
    token: str | None = None
    if file is not None:
        dep = load_deployment(file)
        token = dep.token
        if extra:
            dep = with_extra(dep, list(extra))
        # A fleet file: the parts of this host (--host NAME, else the hosts with one of this machine's addresses).
        here = chosen_hosts(dep, host, local_addresses() if host is None and dep.hosts else ())
        parts = select_parts(deployment_parts(dep), here)
        boots, served, timeout = external_bootstraps(dep), dep.served_model_name, min(timeout, dep.startup_timeout)
        if not any(p.spec is not None for p in parts):  # a fleet host with no engine (its proxy warms up by the deployment's model)
            served = served or dep.model
    elif role is not None:
        plat = platform or ("gpu" if gpus else "cpu")
        parts, boots = role_parts(
            role,
            members,
            model=model or str(tiny_model_path()),
            host=host or "0.0.0.0",
            port=port or (8100 if role == "prefill" else 8200),
            connector=connector,
            transport=protocol or ("tcp" if plat == "cpu" else "rdma"),
            device=device,
            platform=plat,
            gpu=gpu,
            tp=tp,
            block_size=block_size if block_size is not None else (32 if plat == "cpu" else None),
            # P's in-worker bootstrap port is set explicitly, so two prefills on one host never share 8998 by accident.
            bootstrap_port=bootstrap_port if bootstrap_port is not None or role == "decode" or bootstrap else DEFAULT_BOOTSTRAP_PORT,
            bootstrap_url=bootstrap,
            host_ip=host_ip,
            omp_bind=omp_bind,
            served_model_name="tiny" if uses_tiny else None,
            extra_args=tuple(extra or ()),
        )
        served = "tiny" if uses_tiny else None
    else:
        dep = local_deployment(gpus=0 if platform == "cpu" else gpus, model=model, connector=connector,  # type: ignore[arg-type]
                               transport=protocol, device=device, proxy_port=port or 8000)  # type: ignore[arg-type]
        if dep.platform == "cpu":
            p_cores, d_cores = split_cores()
            dep = with_cores(dep, p_cores, d_cores)
        if extra:
            dep = with_extra(dep, list(extra))
        parts, boots, served = deployment_parts(dep), [], dep.served_model_name
    parts = with_vllm_logging(parts, log_dir)
    _hand_out_key(token, parts, json_out)

    if dry_run:
        docs = [_part_doc(p, restart) for p in parts]
        if json_out:
            print_json({"parts": docs})
            return
        for doc in docs:
            console.print(Text(f"# {doc['name']} ({doc['url']})", style=COLORS.get(doc["kind"], "")))
            console.print(doc["command"], highlight=False, markup=False, soft_wrap=True)
        return

    if uses_tiny:
        with err_console.status(f"writing the tiny model to {tiny_model_path()} ..."):
            ensure_tiny_model()
    raise_problems(preflight(parts, boots))
    for line in shared_cores(parts):  # too few cores for every rank: it runs, slower
        if json_out:
            sys.stderr.write(json.dumps({"event": "warning", "message": line}) + "\n")
        else:
            err_console.print(Text(f"pdkv up: warning: {line}", style="yellow"), soft_wrap=True)
    write_logging_config(parts, log_dir)
    _supervise(parts, log_dir=log_dir, timeout=timeout, json_out=json_out, show_logs=not quiet, served=served, trace=trace, once=once,
               restart=restart)


def _hand_out_key(token: str | None, parts: list[Any], json_out: bool) -> str | None:
    """Put the deployment key (the file's, else PDKV_TOKEN's) in the environment every part inherits; warn about
    side channels and bootstraps beyond loopback without one."""
    from pdkv.auth import TOKEN_ENV, token_from_env
    from pdkv.deploy.exposure import exposure_warnings

    token = token or token_from_env()
    if token:
        os.environ[TOKEN_ENV] = token  # never in a plan's env: plans are printed (--dry-run)
    for line in exposure_warnings(parts, keyed=bool(token)):
        if json_out:
            sys.stderr.write(json.dumps({"event": "warning", "message": line}) + "\n")
        else:
            err_console.print(Text(f"pdkv up: warning: {line} (set {TOKEN_ENV}; docs/security.md)", style="yellow"), soft_wrap=True)
    return token


def register(app: typer.Typer) -> None:
    app.command("up", help=HELP)(up)

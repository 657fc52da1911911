"""`pdkv up`: start one P/D role, a deploy.toml, or the built-in local 1P1D, and supervise it."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdkv.cli.options import DEFAULT_LOG_DIR, JsonOpt, LogDirOpt
from pdkv.cli.output import console, err_console, print_json
from pdkv.cli.up_console import UpConsole

if TYPE_CHECKING:
    from pdkv.deploy import Part, PartEvent, ScaleEvent, Startup, Supervisor

HELP = """Start vLLM engines for P/D serving: one role, a deployment file, or a whole local 1P1D.

With no arguments, starts bootstrap, prefill, decode and proxy on this host
(on CPU with the embedded tiny model when no GPU is present), waits for each
to be healthy and stops them all on Ctrl-C, SIGTERM or SIGHUP (its terminal
closed). On a terminal it shows one live screen: each part's state, pid,
uptime and restarts, then what `pdkv top` shows (engines, requests, TTFT and
ITL, errors, transfers); the logs go to .pdkv/logs/ only, and a part that exits
shows its log's path. --logs streams the logs instead, as without a terminal or
with --json. Pre-flight checks (ports, model, P/D agreement, bootstrap) run
first. The parts never outlive it: if it is killed (SIGKILL, out of memory),
its watchdog stops them within seconds. What it started is recorded in the log
folder; a later `pdkv up` there that would start the same parts names the live
ones instead, and `pdkv down` stops them.
A deployment file with an \\[autoscale] table also starts engines within its
bounds when the proxy's planner asks for more, and drains and stops them when
it asks for fewer (docs/planner.md); --json prints a "scale" event per step.

Examples:

  pdkv up

  pdkv up --logs          # the parts' logs instead of the live view

  pdkv up --trace --once

  pdkv up -f deploy.toml

  pdkv up -f fleet.toml --host B

  pdkv up -f autoscale.toml --json   # \\[autoscale]: engines started and drained as the proxy's planner asks

  pdkv up --role prefill --model /models/Qwen3-8B --gpu 0 --device mlx5_0

  pdkv up --role decode --model /models/Qwen3-8B --gpu 2 --port 8200 --dry-run --json

  pdkv up --role prefill --model M --bootstrap http://10.0.0.2:8998 -- --enforce-eager

  pdkv up --role decode --model M --members http://10.0.0.1:8998   # join a running deployment
"""

COLORS = {"bootstrap": "magenta", "prefill": "cyan", "decode": "green", "proxy": "yellow"}
STATE_STYLE = {"waiting": "dim", "starting": "yellow", "ready": "green", "restarting": "yellow", "failed": "red", "exited": "red",
               "stopped": "dim"}


def _command_line(env: dict[str, str], argv: list[str]) -> str:
    return shlex.join([f"{k}={v}" for k, v in env.items()] + argv)


def _part_doc(part: Part, restart: str | None) -> dict[str, Any]:
    launch = part.launch
    return {"name": launch.name, "kind": part.kind, "url": launch.url, "argv": launch.argv, "env": launch.env,
            "command": _command_line(launch.env, launch.argv), "restart": restart or part.restart}


def _status_table(sup: Supervisor, kinds: dict[str, str]) -> Table:
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


def _ready_message(parts: list[Part], served: str | None) -> list[Text]:
    proxy = next((p for p in parts if p.kind == "proxy"), None)
    target = proxy or next((p for p in parts if p.kind in ("prefill", "decode")), None)
    if target is None:  # a fleet host with only a bootstrap server
        return [Text("ready.", style="bold green"), Text("Ctrl-C (or pdkv down, elsewhere) stops every part.", style="dim")]
    model = served or (target.spec.model if target.spec else "MODEL")
    body = json.dumps({"model": model, "prompt": "The river runs north to the city", "max_tokens": 16})
    curl = f"  curl -s {target.launch.url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"
    lines = [Text("ready. Send a request:", style="bold green"), Text(curl)]
    if proxy is not None:
        lines.append(Text(f"  pdkv status --proxy {proxy.launch.url}"))
        lines.append(Text(f"  pdkv trace --proxy {proxy.launch.url}"))
    lines.append(Text("Ctrl-C (or pdkv down, elsewhere) stops every part.", style="dim"))
    return lines


def _run_trace_hook(parts: list[Part], emit: Callable[..., None], json_out: bool) -> None:
    """`--trace`: send one request through the ready deployment and print its timeline (`pdkv trace`)."""
    import msgspec

    from pdkv.cli.trace import render_trace
    from pdkv.trace import run_trace

    proxy = next((p for p in parts if p.kind == "proxy"), None)
    if proxy is None:
        err_console.print("--trace: this deployment has no proxy to trace through")
        return
    trace = run_trace(proxy.launch.url)
    if json_out:
        emit("trace", trace=msgspec.to_builtins(trace))
    else:
        render_trace(trace)


def _supervise(startup: Startup, *, log_dir: Path, json_out: bool, show_logs: bool, trace: bool, once: bool = False,
               restart: str | None = None, live_view: bool = False) -> None:
    """Start, warm up, (trace,) watch and stop the startup's parts, rendering each step: line by line, or with
    `live_view` (a terminal, not --json) as the console (pdkv.cli.up_console: the parts and the deployment's live
    view, the logs to files only)."""
    from pdkv.deploy import PartsRun

    parts = startup.parts
    kinds = {p.launch.name: p.kind for p in parts}
    width = max(len(n) for n in kinds)
    live: Live | None = None
    screen: UpConsole | None = None

    def on_line(name: str, line: str) -> None:
        kind = kinds.get(name, name.rsplit("-", 1)[0])  # an engine added by [autoscale] is named by its role
        prefix = Text(f"{name:<{width}} | ", style=COLORS.get(kind, ""))
        (live.console if live else console).print(prefix + Text(line), highlight=False, soft_wrap=True)

    def emit(event: str, **fields: Any) -> None:
        if json_out:
            sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
            sys.stdout.flush()

    def on_event(event: PartEvent) -> None:
        if json_out:
            emit(event.kind, name=event.name, message=event.message, code=event.code, delay_s=event.delay_s, pid=event.pid)
        else:
            style = {"restarted": "green", "started": "green", "gave-up": "bold red"}.get(event.kind, "yellow")
            if screen is not None:
                screen.note(Text(f"{time.strftime('%H:%M:%S')} {event.message}", style=style, no_wrap=True, overflow="ellipsis"))
                proc = next((p for p in sup.procs if p.name == event.name), None)
                if proc is not None and event.kind == "exited":  # its last line is in the message; the rest is in its log
                    screen.note(Text(f"         log: {proc.log_path}", style=style))
            else:
                err_console.print(Text(f"pdkv up: {event.message}", style=style), highlight=False, soft_wrap=True)

    def on_scale(event: ScaleEvent) -> None:
        if json_out:
            emit("scale", kind=event.kind, role=event.role, name=event.name, message=event.message, desired=event.desired,
                 active=event.active, in_flight=event.in_flight, log=event.log)
        else:
            style = {"scale-up": "cyan", "stopped": "green", "scale-failed": "bold red"}.get(event.kind, "yellow")
            if screen is not None:
                screen.note(Text(f"{time.strftime('%H:%M:%S')} autoscale: {event.message}", style=style, no_wrap=True,
                                 overflow="ellipsis"))
            else:
                err_console.print(Text(f"pdkv up: autoscale: {event.message}", style=style), highlight=False, soft_wrap=True)
                for line in event.log:
                    err_console.print(Text(f"  {event.name} | {line}", style="dim"), highlight=False, soft_wrap=True)

    stream = show_logs and not json_out and not live_view
    run = PartsRun(parts, log_dir, restart=restart, on_line=on_line if stream else None,  # type: ignore[arg-type]
                   on_event=on_event, autoscale=startup.autoscale, on_scale=on_scale, command=["pdkv", *sys.argv[1:]])
    sup = run.supervisor
    with run:
        try:
            if live_view:
                screen = UpConsole(sup, kinds)
                screen.start()
            elif not json_out:
                live = Live(_status_table(sup, kinds), console=console, refresh_per_second=4, transient=False)
                sup.on_change = lambda: live.update(_status_table(sup, kinds)) if live is not None else None
                live.start()
            emit("starting", parts=[{"name": p.launch.name, "url": p.launch.url} for p in parts], log_dir=str(log_dir))
            try:
                total = run.start(startup.timeout)
            finally:
                if live is not None:
                    live.stop()
                    live = None
            warmup_ms = run.warm_up(startup.served, startup.timeout)
            emit("ready", ready_s=round(total, 1), warmup_ms=[round(ms, 1) for ms in warmup_ms],
                 parts=[{"name": p.name, "url": p.url, "pid": p.pid, "log": str(p.log_path)} for p in sup.procs])
            if not json_out:
                took = ", ".join(f"{ms:.0f}" for ms in warmup_ms)
                warmed = f" (warm-up request{'s' * (len(warmup_ms) > 1)} {took} ms)" if warmup_ms else ""
                lines = [Text(f"all {len(parts)} parts ready in {total:.1f} s{warmed}; logs in {log_dir}/"),
                         *_ready_message(parts, startup.served)]
                if screen is not None:
                    screen.serve(next((p.launch.url for p in parts if p.kind == "proxy"), None), lines)
                else:
                    for line in lines:
                        console.print(line, soft_wrap=True)  # the curl line must stay one pastable line
            if trace:
                _run_trace_hook(parts, emit, json_out)
            if not once:
                run.watch()
        except KeyboardInterrupt:
            if not json_out:
                with contextlib.suppress(OSError):  # after SIGHUP the terminal is gone: writing to it fails
                    err_console.print("stopping every part ...")
        finally:
            # after SIGHUP the terminal is gone: drawing on it fails, and the stop goes on
            if live is not None:
                with contextlib.suppress(OSError):
                    live.stop()
            if screen is not None:
                with contextlib.suppress(OSError):
                    screen.stop()
    with contextlib.suppress(OSError):  # after SIGHUP the terminal is gone: writing to it fails
        emit("stopped", pids=sup.pids())
        if not json_out:
            err_console.print("stopped.")


def up(
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Deployment file (TOML) to start.")] = None,
    role: Annotated[str | None, typer.Option("--role", help="Start one engine: prefill or decode.")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m",
        help="Model directory or hub id (default: the embedded tiny model).")] = None,
    connector: Annotated[str, typer.Option("--connector", help="KV connector: pdkv or mooncake (vLLM's own).")] = "pdkv",
    transport: Annotated[str | None, typer.Option("--transport",
        help="How the KV moves: rdma or tcp (Mooncake); ipc (CUDA IPC between GPUs of this host; list both GPUs in --gpu, own first); cma "
        "(host memory between processes of this host, CPU); socket (pdkv's own TCP, any hosts, CPU or GPU). "
        "Local 1P1D on CPU: cma.")] = None,
    device: Annotated[str, typer.Option("--device", help="RDMA device name, e.g. mlx5_0.")] = "",
    gpu: Annotated[str | None, typer.Option("--gpu", help="GPU index(es) for CUDA_VISIBLE_DEVICES, e.g. 0 or 0,1.")] = None,
    port: Annotated[int | None, typer.Option("--port",
        help="Engine port with --role (8100 P, 8200 D); else the proxy port (8000).")] = None,
    host: Annotated[str | None, typer.Option("--host",
        help="With -f: the [[hosts]] name whose parts to start (default: the hosts with an address of this machine).",
        show_default=False)] = None,
    listen: Annotated[str | None, typer.Option("--listen",
        help="With --role: the address the engine listens on (default 0.0.0.0).", show_default=False)] = None,
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
    log_dir: LogDirOpt = DEFAULT_LOG_DIR,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Do not stream the parts' logs (they still go to --log-dir).")] = False,
    logs: Annotated[bool, typer.Option("--logs",
        help="On a terminal, stream every part's log as without one, instead of the live view.")] = False,
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
    from pdkv.auth import TOKEN_ENV
    from pdkv.deploy import UpOptions, hand_out_key, prepare, resolve, shared_cores
    from pdkv.tinymodel import ensure_tiny_model, tiny_model_path

    options = UpOptions(file=file, role=role, model=model, connector=connector, transport=transport, device=device,
                        gpu=gpu, port=port, host=host, listen=listen, host_ip=host_ip, bootstrap_port=bootstrap_port,
                        bootstrap=bootstrap, members=members, block_size=block_size, tp=tp, platform=platform, omp_bind=omp_bind,
                        timeout=timeout, restart=restart, extra=tuple(extra or ()))
    startup = resolve(options, log_dir)
    for line in [*startup.notes, *hand_out_key(startup.token, startup.parts)]:
        if json_out:
            sys.stderr.write(json.dumps({"event": "warning", "message": line}) + "\n")
        else:
            err_console.print(Text(f"pdkv up: warning: {line} (set {TOKEN_ENV}; docs/security.md)", style="yellow"), soft_wrap=True)

    if dry_run:
        docs = [_part_doc(p, restart) for p in startup.parts]
        if json_out:
            print_json({"parts": docs})
            return
        for doc in docs:
            console.print(Text(f"# {doc['name']} ({doc['url']})", style=COLORS.get(doc["kind"], "")))
            console.print(doc["command"], highlight=False, markup=False, soft_wrap=True)
        return

    if startup.uses_tiny:
        with err_console.status(f"writing the tiny model to {tiny_model_path()} ..."):
            ensure_tiny_model()
    prepare(startup, log_dir)
    for line in shared_cores(startup.parts):  # too few cores for every rank: it runs, slower
        if json_out:
            sys.stderr.write(json.dumps({"event": "warning", "message": line}) + "\n")
        else:
            err_console.print(Text(f"pdkv up: warning: {line}", style="yellow"), soft_wrap=True)
    live_view = console.is_terminal and not logs and not json_out
    _supervise(startup, log_dir=log_dir, json_out=json_out, show_logs=not quiet, trace=trace, once=once, restart=restart,
               live_view=live_view)


def register(app: typer.Typer) -> None:
    app.command("up", help=HELP)(up)

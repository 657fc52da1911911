"""`pdkv status`: is every part of a P/D deployment up, who is registered, what is in flight."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdkv.cli.options import AdminKeyOpt, JsonOpt
from pdkv.cli.output import console, print_json, to_builtins

HELP = """Show the health of each part, the bootstrap registrations, and the proxy's in-flight requests and errors.

Exits 1 when some part is down.

Examples:

  pdkv status

  pdkv status --proxy http://10.0.0.5:8000 --json

  pdkv status -f deploy.toml --watch

  pdkv status -f fleet.toml          # every host's parts
"""

DEFAULT_PROXY = "http://127.0.0.1:8000"


def _render(report: Any) -> Group:
    parts = Table(title="parts", show_header=True)
    fleet = any(p.host for p in report.parts)
    for col in ("part", *(("host",) if fleet else ()), "kind", "url", "health", "detail"):
        parts.add_column(col)
    for p in report.parts:
        health = Text("up", style="green") if p.up else Text("down", style="red")
        parts.add_row(p.name, *((p.host,) if fleet else ()), p.kind, p.url, health, p.detail)
    blocks: list[Any] = [parts]
    regs = Table(title="bootstrap registrations", show_header=True)
    for col in ("bootstrap", "dp", "engine id", "tp", "pp", "side channel"):
        regs.add_column(col)
    for r in report.registrations:
        regs.add_row(r.bootstrap, str(r.dp_rank), r.engine_id, str(r.tp_rank), str(r.pp_rank), r.addr)
    blocks.append(regs if report.registrations else Text("bootstrap registrations: none", style="dim"))
    if report.proxy is not None:
        px = report.proxy
        flight = ", ".join(f"{url} {n}" for url, n in px.in_flight.items()) or "none"
        errors = ", ".join(f"{cause} {n}" for cause, n in sorted(px.errors.items())) or "none"
        blocks.append(Text(f"proxy {px.url}: {px.requests} requests answered; in flight: {flight}; errors: {errors}"))
        for e in px.recent_errors:
            what = f"{e.request_id} {e.error or '?'} (status {e.status if e.status is not None else '?'})"
            blocks.append(Text(f"  recent error: {what}", style="red"))
    return Group(*blocks)


def status(
    proxy: Annotated[str | None, typer.Option("--proxy", help=f"Proxy URL; its /health names the parts (default {DEFAULT_PROXY}).")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Deployment file whose parts to poll.")] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes with --watch.")] = 2.0,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds each probe may take.")] = 2.0,
    admin_key: AdminKeyOpt = None,
    json_out: JsonOpt = False,
) -> int:
    from pdkv.deploy import collect_status, load_deployment, part_hosts, status_targets
    from pdkv.errors import UsageError

    if proxy and file:
        raise UsageError("give either --proxy or -f, not both")
    targets: list[tuple[str, str, str]] = []
    boots: list[str] = []
    proxy_url = proxy
    hosts: dict[str, str] = {}
    if file is not None:
        dep = load_deployment(file)
        targets, boots, proxy_url = status_targets(dep)
        hosts = part_hosts(dep)
    elif proxy_url is None:
        from pdkv.deploy import deployment_parts, local_deployment

        # Nothing given: the parts of the built-in local topology (`pdkv up` with no arguments).
        parts = deployment_parts(local_deployment(gpus=0))
        targets = [(p.launch.name, p.kind, p.launch.url) for p in parts]
        boots = sorted({p.bootstrap_url for p in parts if p.bootstrap_url})
        proxy_url = next(p.launch.url for p in parts if p.kind == "proxy")

    def poll() -> Any:
        return collect_status(proxy_url=proxy_url, targets=targets, bootstraps=boots, timeout=timeout, hosts=hosts,
                              admin_key=admin_key)

    if not watch:
        report = poll()
        if json_out:
            print_json({"ok": report.ok, **to_builtins(report)})
        else:
            console.print(_render(report))
        return 0 if report.ok else 1
    try:
        if json_out:
            while True:
                report = poll()
                sys.stdout.write(json.dumps({"time": round(time.time(), 3), "ok": report.ok, **to_builtins(report)}) + "\n")
                sys.stdout.flush()
                time.sleep(interval)
        with Live(_render(poll()), console=console, refresh_per_second=2) as live:
            while True:
                time.sleep(interval)
                live.update(_render(poll()))
    except KeyboardInterrupt:
        return 0


def register(app: typer.Typer) -> None:
    app.command("status", help=HELP)(status)

"""`pdkv top`: the live view of a running deployment, through its proxy."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.live import Live

from pdkv.cli.live_view import render_view
from pdkv.cli.options import AdminKeyOpt, JsonOpt
from pdkv.cli.output import console, print_json, to_builtins
from pdkv.errors import ExitCode

HELP = """Watch a running P/D deployment: its engines, request rate, TTFT and ITL, errors, transfers.

Reads the proxy's /health (which engines there are) and /metrics (requests,
TTFT, errors, local fallbacks, the planner's counts) and each engine's
/metrics (running and waiting requests, KV usage, pdkv's connector's
transfers, bytes, failures and recomputes) once a refresh; rates and
p50/p90 are over the time between two refreshes. Ctrl-C stops it.

--once reads twice, --interval apart, prints the view and exits: 0 when the
proxy and every engine are up, 1 when one is not (as `pdkv status`).

Examples:

  pdkv top

  pdkv top --proxy http://10.0.0.5:8000 --interval 2

  pdkv top --once --json | jq .serving.ttft_p90_ms
"""

DEFAULT_PROXY = "http://127.0.0.1:8000"


def top(
    proxy: Annotated[str, typer.Option("--proxy", help="The deployment's proxy URL.")] = DEFAULT_PROXY,
    interval: Annotated[float, typer.Option("--interval", min=0.2, help="Seconds between refreshes.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Read twice, --interval apart, print the view and exit.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds each GET may take.")] = 2.0,
    admin_key: AdminKeyOpt = None,
    json_out: JsonOpt = False,
) -> int:
    from pdkv.errors import UsageError
    from pdkv.top import DeploymentReader, view

    if json_out and not once:
        raise UsageError("--json prints one view: give --once too")
    with DeploymentReader(proxy, timeout=timeout, admin_key=admin_key) as reader:
        before = reader.read()
        if once:
            time.sleep(interval)
            current = view(before, reader.read())
            if json_out:
                print_json({"ok": current.ok, **to_builtins(current)})
            else:
                console.print(render_view(current))
            return ExitCode.OK if current.ok else ExitCode.FAILED
        try:
            with Live(render_view(view(None, before)), console=console, refresh_per_second=4, screen=False) as live:
                while True:
                    time.sleep(interval)
                    now = reader.read()
                    live.update(render_view(view(before, now)))
                    before = now
        except KeyboardInterrupt:
            return ExitCode.OK


def register(app: typer.Typer) -> None:
    app.command("top", help=HELP)(top)

"""`pdkv down`: stop what a `pdkv up` started, from its record beside the logs."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from pdkv.cli.options import DEFAULT_LOG_DIR, JsonOpt, LogDirOpt
from pdkv.cli.output import console, err_console, print_json, to_builtins
from pdkv.errors import ExitCode

HELP = """Stop the deployment a `pdkv up` started with the same --log-dir, from another terminal or a script.

A `pdkv up` that still runs gets SIGTERM and stops its parts as on Ctrl-C (the
proxy first, requests in flight given their grace); when it is gone (its
terminal closed, killed), its parts that are still alive are stopped directly:
SIGTERM, then SIGKILL after --grace seconds. Each `pdkv up` records what it
started in its log folder (pdkv-up-PID.json); a later `pdkv up` that would
start the same parts names them and this command.

Exit codes: 0 every part stopped (or nothing ran), 1 something is still alive
after the bound.

Examples:

  pdkv down

  pdkv down --log-dir /var/log/pdkv --pid 4242

  pdkv down --json
"""


def down(
    log_dir: LogDirOpt = DEFAULT_LOG_DIR,
    pid: Annotated[int | None, typer.Option("--pid", help="Stop only the deployment of this `pdkv up` (its pid).",
                                            show_default=False)] = None,
    grace: Annotated[float, typer.Option("--grace", help="Seconds each part has to stop on SIGTERM before SIGKILL.")] = 10.0,
    timeout: Annotated[float, typer.Option("--timeout",
        help="Seconds a running `pdkv up` has to stop its parts before they are stopped directly.")] = 60.0,
    json_out: JsonOpt = False,
) -> None:
    from pdkv.deploy import stop_recorded

    stopped = stop_recorded(log_dir, pid, grace=grace, timeout=timeout)
    failed = any(s.left for s in stopped)
    if json_out:
        print_json({"log_dir": str(log_dir), "deployments": to_builtins(stopped)})
    elif not stopped:
        which = f"of pdkv up {pid} " if pid is not None else ""
        console.print(f"nothing {which}recorded in {log_dir} runs", highlight=False, soft_wrap=True)
    for s in [] if json_out else stopped:
        how = "pdkv up stopped them" if s.up_alive else "stopped directly: its pdkv up was gone"
        console.print(f"`{s.command}` (pid {s.pid}): {', '.join(s.stopped) or 'no part'}; {how} in {s.seconds:.1f} s", highlight=False,
                      soft_wrap=True)
        if s.left:
            err_console.print(Text(f"  still alive: {', '.join(s.left)}", style="bold red"), highlight=False, soft_wrap=True)
    if failed:
        raise typer.Exit(int(ExitCode.FAILED))


def register(app: typer.Typer) -> None:
    app.command("down", help=HELP)(down)

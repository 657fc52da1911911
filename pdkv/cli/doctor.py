"""`pdkv doctor`: say exactly why P/D over Mooncake will not work on this host, and how to fix it."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer
from rich.table import Table

from pdkv.cli.options import JsonOpt
from pdkv.cli.output import console, print_json

HELP = """Check this host for P/D over Mooncake: RDMA NICs and ports, GPUDirect RDMA,
memlock, RoCE GIDs, GPU/NIC NUMA placement, environment, Mooncake, vLLM and ports.

Failures come first, each with its fix. Exit 0 when nothing fails (warnings do
not fail), 4 when any check fails. PDKV_SYS_ROOT points every sysfs, procfs and
/dev read at another root (a fixture tree, a mounted host root).

Examples:

  pdkv doctor --device mlx5_0

  pdkv doctor --transport tcp --skip-mooncake

  pdkv doctor --transport cma

  pdkv doctor --transport socket

  pdkv doctor --device mlx5_0 --port 8000 --port 8998 --port 8100 --port 8200 --json
"""

_STYLE = {"fail": ("FAIL", "bold red"), "warn": ("WARN", "yellow"), "pass": ("ok", "green"), "skip": ("skip", "dim")}


class TransportChoice(StrEnum):
    rdma = "rdma"
    tcp = "tcp"
    cma = "cma"
    socket = "socket"


DeviceOpt = Annotated[
    str | None,
    typer.Option("--device", "-d", help="RDMA device the deployment uses (Mooncake's device_name), e.g. mlx5_0; commas for several."),
]
TransportOpt = Annotated[
    TransportChoice,
    typer.Option(
        "--transport", "-p",
        help="KV transport: rdma or tcp (Mooncake), cma (P and D on one CPU host) or socket (pdkv's TCP); "
        "tcp, cma and socket skip the RDMA-only checks.",
    ),
]
PortOpt = Annotated[
    list[int] | None,
    typer.Option("--port", help="A port the deployment listens on; repeat it. Default: 8000 8998 8010 8020."),
]
SkipMooncakeOpt = Annotated[bool, typer.Option("--skip-mooncake", help="Do not start a Mooncake TransferEngine.")]
MooncakeTimeoutOpt = Annotated[float, typer.Option("--mooncake-timeout", help="Seconds the TransferEngine may take to start.")]


def doctor(
    device: DeviceOpt = None,
    transport: TransportOpt = TransportChoice.rdma,
    port: PortOpt = None,
    skip_mooncake: SkipMooncakeOpt = False,
    mooncake_timeout: MooncakeTimeoutOpt = 30.0,
    json_out: JsonOpt = False,
) -> None:
    from pdkv.doctor import DEFAULT_PORTS, DoctorOptions, run_doctor
    from pdkv.errors import ChecksFailed, UsageError

    if port and any(not 0 < p < 65536 for p in port):
        raise UsageError(f"--port must be 1-65535, got {', '.join(map(str, port))}")
    options = DoctorOptions(
        transport=transport.value,
        device=device,
        ports=tuple(port) if port else DEFAULT_PORTS,
        skip_mooncake=skip_mooncake,
        mooncake_timeout_s=mooncake_timeout,
    )
    if json_out:
        report = run_doctor(options)
        print_json(report)
    else:
        with console.status("running checks ...") as status:
            done: list[str] = []

            def progress(result) -> None:
                done.append(result.name)
                status.update(f"running checks ... {len(done)} done, last: {result.name}")

            report = run_doctor(options, on_result=progress)
        _render(report)
    if not report.ok:
        # One line that says why on its own (a Kubernetes init container's termination message is this line).
        names = [c.name for c in report.failed]
        first = report.failed[0]
        raise ChecksFailed(
            f"{len(names)} check(s) failed: {', '.join(names)}; {first.name}: {' '.join(first.detail.split())}",
            hint="; ".join(h for h in (first.hint, "apply each fix shown, then run pdkv doctor again") if h),
        )


def _render(report) -> None:
    where = f", root {report.sys_root}" if report.sys_root not in ("/", "") else ""
    table = Table(title=f"pdkv doctor: transport {report.transport}, device {report.device or 'any'}{where}", show_lines=False)
    table.add_column("", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("seen")
    table.add_column("fix")
    for check in report.checks:
        label, style = _STYLE[check.status.value]
        table.add_row(f"[{style}]{label}[/]", check.name, check.detail, check.hint)
    console.print(table)
    c = report.counts
    console.print(f"{c['fail']} failed, {c['warn']} warnings, {c['pass']} passed, {c['skip']} skipped in {report.elapsed_s:.2f} s")


def register(app: typer.Typer) -> None:
    app.command("doctor", help=HELP)(doctor)

"""`pdkv bench`: time KV transfer the way the connector performs it; `serve` is the decode side for two hosts."""

from __future__ import annotations

import csv
from pathlib import Path

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pdkv.cli.options import BlockSizeOpt, DtypeOpt, HeadDimOpt, JsonOpt, KvHeadsOpt, LayersOpt, ModelOpt
from pdkv.cli.output import console, err_console, print_json
from pdkv.errors import UsageError

HELP = """Measure KV transfer exactly as the connector performs it: a model's per-layer
KV regions, registered with Mooncake, blocks written by pdkv's planner and
transport into a second process (or, with `run --target`, another host).

Reports bytes (equal to `pdkv plan`'s), descriptors after coalescing, the cold
first transfer, min/p50/p90/p99/max, GB/s and percent of the link, and the
planning time apart. Every case checks the bytes that arrived against the
source and fails (exit 1) on a mismatch.

Examples:

  pdkv bench --layers 36 --kv-heads 8 --head-dim 128 --blocks 63 --layout all --baseline

  pdkv bench --model ./Qwen3-8B --sweep blocks=1,16,63,256 --sweep layout=all --csv bench.csv

  pdkv bench --model ./Qwen3-8B --src cuda:0 --dst cuda:1 --transport tcp --json

  pdkv bench --model ./Qwen3-8B --src cuda:0 --dst cuda:1 --transport ipc --layout all --baseline

  pdkv bench --model ./Qwen3-8B --transport cma --layout all --baseline

  pdkv bench --model ./Qwen3-8B --tp 2:1 --transport cma    # D TP 1 takes half its heads from each of 2 P ranks

  pdkv bench --model ./Qwen3-8B --transport socket --layout all --baseline --connections 8 --socket-buffer 0

  pdkv bench serve --host 0.0.0.0 --port 18600 --transport rdma --device mlx5_0 --dst cuda:0

  pdkv bench run --target 10.0.0.2:18600 --model ./Qwen3-8B --transport rdma --device mlx5_0 --src cuda:0
"""

SERVE_HELP = """Run the decode side of a two-host benchmark: answers `pdkv bench run --target`
from the prefill host, allocating KV regions on --dst and hashing what arrived.
Serves until Ctrl-C (or, with --once, until one run ends).

Examples:

  pdkv bench serve --host 0.0.0.0 --port 18600

  pdkv bench serve --host 10.0.0.2 --port 18600 --transport rdma --device mlx5_0 --dst cuda:0 --json
"""

TRANSPORT_HELP = ("tcp or rdma (Mooncake), ipc (CUDA IPC between GPUs of this host), cma (host memory between processes of this host), "
                 "or socket (pdkv's own TCP; with --baseline, Mooncake tcp in the same run).")

bench_app = typer.Typer(help=HELP, no_args_is_help=False, invoke_without_command=True)


def bench(
    ctx: typer.Context,
    blocks: int = typer.Option(63, "--blocks", help="KV blocks per transfer (63 = a 1000-token prompt at block size 16)."),
    model: ModelOpt = None,
    layers: LayersOpt = None,
    kv_heads: KvHeadsOpt = None,
    head_dim: HeadDimOpt = None,
    dtype: DtypeOpt = None,
    block_size: BlockSizeOpt = 16,
    transport: str = typer.Option("tcp", "--transport", help=TRANSPORT_HELP),
    device: str = typer.Option("", "--device", help="RDMA device(s) for rdma, e.g. mlx5_0; also where the link rate is read."),
    src: str = typer.Option("cpu", "--src", help="Where P's KV lives: cpu or cuda:N."),
    dst: str = typer.Option("cpu", "--dst", help="Where D's KV lives: cpu or cuda:N (local target only)."),
    layout: list[str] = typer.Option(["contiguous"], "--layout", help="contiguous, per-block, scattered or all; repeatable."),
    iters: int = typer.Option(20, "--iters", help="Timed transfers per case."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed transfers after the cold one."),
    seed: int = typer.Option(0, "--seed", help="Seed of the source bytes and the scattered block ids."),
    sweep: list[str] = typer.Option([], "--sweep", help="Vary blocks or layout: blocks=1,16,63,256 or layout=all; repeatable."),
    baseline: bool = typer.Option(False, "--baseline", help="Also time bare TransferEngine calls and Mooncake's transfer_engine_bench."),
    link_gbps: float | None = typer.Option(None, "--link-gbps", help="Link rate in Gb/s \\[default: sysfs rate of --device, else 400]."),
    target: str | None = typer.Option(None, "--target", help="HOST:PORT of `pdkv bench serve` (default: a local child process)."),
    hostname: str | None = typer.Option(
        None, "--hostname", help="Address this side's Mooncake advertises \\[default: route to the target]."
    ),
    mc: list[str] = typer.Option([], "--mc", help="A Mooncake setting, MC_NAME=VALUE; repeatable."),
    csv_file: Path | None = typer.Option(None, "--csv", help="Also write one row per case to this CSV file."),
    tp: str = typer.Option("1", "--tp", help="TP size (one rank's KV), or P:D: D rank 0's heads written from each P rank holding them."),
    connections: int = typer.Option(
        0, "--connections", help="socket: P's TCP connections to D \\[default: the cores, at most 4].", show_default=False
    ),
    socket_buffer: int | None = typer.Option(
        None, "--socket-buffer", help="socket: each connection's socket buffers in bytes, both sides; 0: autotuning \\[default: 96 KiB]."
    ),
    json_out: JsonOpt = False,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    from pdkv.bench import run_bench, spec_from_options

    spec = spec_from_options(
        model=model, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, block_size=block_size, blocks=blocks,
        layout=layout, sweep=sweep, transport=transport, device=device, src=src, dst=dst, iters=iters, warmup=warmup, seed=seed,
        link_gbps=link_gbps, baseline=baseline, target=target, hostname=hostname, mc=mc, tp=tp,
        connections=connections, socket_buffer=socket_buffer,
    )  # fmt: skip
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    ) as progress:
        tasks: dict[str, int] = {}

        def on_progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = progress.add_task(label, total=total)
            progress.update(tasks[label], completed=done)

        report = run_bench(spec, on_progress)
    if csv_file is not None:
        _write_csv(csv_file, report)
    if json_out:
        print_json(report)
        return
    _render(report)


def _table(title: str, columns: tuple[str, ...]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_header=True, header_style="bold", pad_edge=False)
    for name in columns:
        table.add_column(name, justify="left" if name == "layout" else "right")
    return table


def _render(report) -> None:
    g = report.geometry
    console.print(
        f"[bold]pdkv bench[/]: {g.layers} layers x {g.kv_heads} KV heads x {g.head_dim} x {g.dtype_bytes} B, "
        f"{report.block_size}-token blocks ({report.block_len:,} B per layer), {report.transport} {report.src} -> {report.dst} "
        f"via {report.peer}, link {report.link_gbps:g} Gb/s ({report.link_source})"
    )
    moved = _table("what moves", ("layout", "blocks", "bytes", "descriptors", "plan ms", "cold ms", "verified"))
    times = _table(
        f"transfer, ms over {report.cases[0].timing.iters} writes",
        ("layout", "blocks", "min", "p50", "p90", "p99", "max"),
    )
    rate = _table(f"rate (link {report.link_gbps:g} Gb/s)", ("layout", "blocks", "GB/s at p50", "GB/s over the run", "% of link at p50"))
    bare_name = {"ipc": "copy_ p50", "cma": "memmove p50", "socket": "Mooncake tcp p50"}.get(report.transport, "bare p50")
    base = _table("baseline (same descriptors)", ("layout", "blocks", "pdkv p50", bare_name, "pdkv/baseline", "teb GB/s", "pdkv/teb"))
    for c in report.cases:
        t, key = c.timing, (c.layout, str(c.blocks))
        moved.add_row(*key, f"{c.bytes:,}", str(c.descriptors), f"{c.plan_ms:.2f}", f"{c.cold_ms:.1f}", "yes" if c.verified else "NO")
        times.add_row(
            *key,
            *(f"{v:.2f}" for v in (t.min_ms, t.p50_ms, t.p90_ms, t.p99_ms, t.max_ms)),
        )
        rate.add_row(*key, f"{t.gbps_p50:.2f}", f"{t.gbps_run:.2f}", f"{t.link_pct_p50:.2f}")
        if (b := c.baseline) is not None:
            teb = f"{b.teb_gbps:.2f}" if b.teb_gbps is not None else "-"
            ratio = f"{b.teb_ratio:.2f}" if b.teb_ratio is not None else "-"
            base.add_row(*key, f"{t.p50_ms:.2f}", f"{b.bare.p50_ms:.2f}", f"{b.p50_ratio:.3f}", teb, ratio)
    console.print(moved)
    console.print(times)
    console.print(rate)
    if base.row_count:
        console.print(base)
        notes = sorted({f"{c.layout}: {c.baseline.teb_note}" for c in report.cases if c.baseline and c.baseline.teb_note})
        for note in notes:
            console.print(f"[dim]{note}[/]" if report.transport in ("ipc", "cma", "socket") else f"[dim]transfer_engine_bench {note}[/]")
    for c in (c for c in report.cases if c.rank_bytes):
        shares = ", ".join(f"P{p} {n:,} B" for p, n in sorted(c.rank_bytes.items(), key=lambda kv: int(kv[0])))
        console.print(f"{c.layout}, {c.blocks} blocks: D rank 0 takes {shares} ({c.bytes:,} B, one write per P rank)")
    if report.note:
        console.print(f"[yellow]{report.note}[/]")


CSV_FIELDS = [
    "layout", "blocks", "bytes", "plan_bytes", "descriptors", "plan_ms", "cold_ms",
    "min_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms", "mean_ms", "gbps_p50", "gbps_run", "link_pct_p50",
    "bare_p50_ms", "p50_ratio", "teb_gbps", "teb_ratio", "verified", "transport", "src", "dst", "link_gbps",
]  # fmt: skip


def _write_csv(path: Path, report) -> None:
    try:
        with path.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
            writer.writeheader()
            for c in report.cases:
                t, b = c.timing, c.baseline
                writer.writerow(
                    {
                        "layout": c.layout, "blocks": c.blocks, "bytes": c.bytes, "plan_bytes": c.plan_bytes,
                        "descriptors": c.descriptors, "plan_ms": f"{c.plan_ms:.4f}", "cold_ms": f"{c.cold_ms:.4f}",
                        "min_ms": f"{t.min_ms:.4f}", "p50_ms": f"{t.p50_ms:.4f}", "p90_ms": f"{t.p90_ms:.4f}",
                        "p99_ms": f"{t.p99_ms:.4f}", "max_ms": f"{t.max_ms:.4f}", "mean_ms": f"{t.mean_ms:.4f}",
                        "gbps_p50": f"{t.gbps_p50:.4f}", "gbps_run": f"{t.gbps_run:.4f}", "link_pct_p50": f"{t.link_pct_p50:.3f}",
                        "bare_p50_ms": f"{b.bare.p50_ms:.4f}" if b else "", "p50_ratio": f"{b.p50_ratio:.4f}" if b else "",
                        "teb_gbps": b.teb_gbps if b and b.teb_gbps is not None else "",
                        "teb_ratio": f"{b.teb_ratio:.4f}" if b and b.teb_ratio is not None else "",
                        "verified": c.verified, "transport": report.transport, "src": report.src, "dst": report.dst,
                        "link_gbps": report.link_gbps,
                    }
                )  # fmt: skip
    except OSError as exc:
        raise UsageError(f"cannot write --csv {path}: {exc.strerror or exc}") from None


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on for the control channel (0.0.0.0 for all)."),
    port: int = typer.Option(18600, "--port", help="Control port; 0 picks a free one."),
    advertise: str | None = typer.Option(
        None, "--advertise", help="Address Mooncake advertises \\[default: --host, or this host's address]."
    ),
    transport: str = typer.Option("tcp", "--transport", help=TRANSPORT_HELP),
    device: str = typer.Option("", "--device", help="RDMA device(s) for rdma, e.g. mlx5_0."),
    dst: str = typer.Option("cpu", "--dst", help="Where D's KV lives: cpu or cuda:N."),
    once: bool = typer.Option(False, "--once", help="Exit after one benchmark run ends."),
    mc: list[str] = typer.Option([], "--mc", help="A Mooncake setting, MC_NAME=VALUE; repeatable."),
    socket_buffer: int | None = typer.Option(
        None, "--socket-buffer", help="socket: each connection's socket buffers in bytes; 0: the kernel's autotuning \\[default: 96 KiB]."
    ),
    json_out: JsonOpt = False,
) -> None:
    from pdkv.bench import BenchTarget, check_socket_options, parse_settings, settings_from_env

    check_socket_options(transport, 0, socket_buffer)
    with BenchTarget(
        host, port, advertise=advertise, transport=transport, device_name=device, dst=dst, settings=settings_from_env(parse_settings(mc)),
        socket_buffer_bytes=socket_buffer,
    ) as target:
        if json_out:
            print_json({"address": target.address, "session": target.transport.session_address, "transport": transport, "dst": target.dst})
        else:
            console.print(
                f"bench target on [bold]{target.address}[/] ({transport}, KV on {target.dst}); "
                f"on the prefill host run: pdkv bench run --target {target.address} ..."
            )
        try:
            target.serve(once=once)
        except KeyboardInterrupt:
            err_console.print("bench target stopped")


def register(app: typer.Typer) -> None:
    bench_app.callback(invoke_without_command=True)(bench)
    bench_app.command("run", help="Run the benchmark against `pdkv bench serve` (--target) or a local target.\n\n" + HELP)(bench)
    bench_app.command("serve", help=SERVE_HELP)(serve)
    app.add_typer(bench_app, name="bench", help=HELP)

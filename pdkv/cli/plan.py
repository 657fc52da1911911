"""`pdkv plan`: how many bytes one request's KV is, and how fast the link could move it; with --slo, how many P and D."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from pdkv.cli.options import (
    BlockSizeOpt,
    DtypeOpt,
    HeadDimOpt,
    JsonOpt,
    KvHeadsOpt,
    LayersOpt,
    LinkGbpsOpt,
    ModelOpt,
    resolve_geometry,
)
from pdkv.cli.output import console, print_json
from pdkv.errors import ExitCode, UsageError

HELP = """Size the KV cache one request moves from prefill to decode; with --slo, size the deployment: the fewest
P and D engines that meet TTFT and ITL targets (at the 90th percentile unless --quantile says otherwise) for a
request rate and prompt/output lengths (N, A-B uniform, or A,B,C), or a trace file, from a profile that
`pdkv profile` measured. Prints the predicted TTFT and ITL and which target binds; exits 1 when no count
up to --max-engines meets them. The queueing model is in docs/planner.md.

Examples:

  pdkv plan --model ./Qwen3-8B --prompt-tokens 1000 --output-tokens 128

  pdkv plan --layers 36 --kv-heads 8 --head-dim 128 --dtype bfloat16 --prompt-tokens 1000 --json

  pdkv plan --model ./Qwen3-8B --tp 1:2     # P TP 1, D TP 2: what each P rank writes into each D rank

  pdkv plan --profile h200.profile.json --slo ttft=500,itl=40 --rate 20 --prompt-tokens 200-2000 --output-tokens 128

  pdkv plan --profile h200.profile.json --slo ttft=800,itl=50 --trace requests.jsonl --json
"""


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def plan(
    model: ModelOpt = None,
    layers: LayersOpt = None,
    kv_heads: KvHeadsOpt = None,
    head_dim: HeadDimOpt = None,
    dtype: DtypeOpt = None,
    block_size: BlockSizeOpt = 16,
    prompt_tokens: str = typer.Option("1000", "--prompt-tokens", help="Prompt length in tokens (with --slo: N, A-B or A,B,C)."),
    output_tokens: str = typer.Option("0", "--output-tokens", help="Tokens D generates (with --slo: N, A-B or A,B,C)."),
    tp: str = typer.Option("1", "--tp", help="Tensor-parallel size (sizes are per TP rank), or P:D for P and D of different sizes."),
    link_gbps: LinkGbpsOpt = 400.0,
    slo: str | None = typer.Option(None, "--slo", help="Latency targets in ms, ttft=MS,itl=MS: plan P and D counts."),
    profile: Path | None = typer.Option(None, "--profile", help="Profile file from `pdkv profile` (with --slo)."),
    rate: float | None = typer.Option(None, "--rate", help="Requests per second, all engines together (with --slo)."),
    trace: Path | None = typer.Option(None, "--trace", help="JSON lines of prompt_tokens, output_tokens[, timestamp] (with --slo)."),
    quantile: float = typer.Option(0.9, "--quantile", help="The quantile the targets hold at (with --slo)."),
    max_engines: int = typer.Option(256, "--max-engines", help="Most engines per role to consider (with --slo)."),
    json_out: JsonOpt = False,
) -> None:
    if slo is not None:
        _plan_slo(slo, profile, rate, trace, prompt_tokens, output_tokens, quantile, max_engines, json_out)
        return
    if profile is not None or rate is not None or trace is not None:
        raise UsageError("--profile, --rate and --trace plan engine counts, which needs --slo", hint="e.g. --slo ttft=500,itl=50")
    import msgspec

    from pdkv.geometry import parse_tp_pair, size_transfer, rank_transfers

    p_tp, d_tp = parse_tp_pair(tp)
    geometry = resolve_geometry(model, layers, kv_heads, head_dim, dtype, p_tp if p_tp == d_tp else 1)
    prompt = _int(prompt_tokens, "--prompt-tokens")
    result = size_transfer(
        geometry,
        prompt_tokens=prompt,
        block_size=block_size,
        output_tokens=_int(output_tokens, "--output-tokens"),
        link_gbps=link_gbps,
    )
    if p_tp != d_tp:
        ranks = rank_transfers(geometry, p_tp, d_tp, prompt_tokens=prompt, block_size=block_size)
        result = msgspec.structs.replace(result, ranks=ranks)
    if json_out:
        print_json(result)
        return
    g = result.geometry
    title = "per TP rank" if p_tp == d_tp else f"P TP {p_tp} -> D TP {d_tp}, all ranks"
    table = Table(title=f"KV transfer plan ({title})", show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("how")
    if g.attention == "mla":
        shape = f"{g.layers} layers x {g.head_dim} latent x {g.dtype_bytes} B (MLA)"
    else:
        shape = f"2 x {g.layers} layers x {g.kv_heads} KV heads x {g.head_dim} x {g.dtype_bytes} B"
    table.add_row("KV bytes per token", f"{result.bytes_per_token:,}", shape)
    table.add_row("KV bytes per block", f"{result.bytes_per_block:,}", f"{result.block_size} tokens = {_mib(result.bytes_per_block)}")
    table.add_row(
        "blocks for the prompt",
        str(result.blocks),
        f"ceil({result.prompt_tokens}/{result.block_size}): {result.full_blocks} full + tail of {result.tail_tokens}",
    )
    table.add_row("bytes to move", f"{result.transfer_bytes:,}", _mib(result.transfer_bytes))
    table.add_row("floor", f"{result.floor_ms:.2f} ms", f"at {result.link_gbps:g} Gb/s")
    table.add_row(
        "D blocks at the end",
        str(result.decode_blocks),
        f"ceil({result.prompt_tokens + result.output_tokens}/{result.block_size}) after {result.output_tokens} output tokens",
    )
    console.print(table)
    if result.ranks:
        ranks = Table(title="per rank: what each P rank writes into each D rank", show_header=True)
        for name in ("P rank", "D rank", "KV heads", "bytes", "descriptors"):
            ranks.add_column(name, justify="right")
        for r in result.ranks:
            ranks.add_row(str(r.p_rank), str(r.d_rank), str(r.heads), f"{r.bytes:,}", str(r.descriptors))
        console.print(ranks)
        total = sum(r.bytes for r in result.ranks)
        console.print(f"[dim]descriptors for contiguous blocks: one per layer where whole blocks move, else one per layer and "
                      f"block (a rank's heads are part of each block); the ranks' bytes add up to {total:,}[/]")


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{flag} takes one token count here, got {text!r}", hint="distributions are for --slo plans") from None


def _plan_slo(slo: str, profile: Path | None, rate: float | None, trace: Path | None, prompt_tokens: str, output_tokens: str,
              quantile: float, max_engines: int, json_out: bool) -> None:  # fmt: skip
    from pdkv.planner import load_profile, make_workload, parse_slo, plan_capacity

    if profile is None:
        raise UsageError("--slo needs --profile FILE", hint="measure one with `pdkv profile`")
    if max_engines < 1:
        raise UsageError(f"--max-engines must be at least 1, got {max_engines}")
    targets = parse_slo(slo, quantile)
    prof = load_profile(profile)
    result = plan_capacity(prof, make_workload(rate, prompt_tokens, output_tokens, trace), targets, max_engines=max_engines)
    if json_out:
        print_json(result)
    else:
        render_capacity(result, prof)
    if not result.feasible:
        raise typer.Exit(int(ExitCode.FAILED))


def _lat(ms: float) -> str:
    return "never (overloaded)" if ms == float("inf") else f"{ms:,.1f} ms"


def render_capacity(result, prof) -> None:
    q = f"p{result.slo.quantile * 100:g}"
    console.print(f"[bold]pdkv plan[/]: {result.rate:g} req/s, prompts {result.mean_prompt_tokens:,.0f} tokens and outputs "
                  f"{result.mean_output_tokens:,.0f} on average; profile of {prof.model.name} on {prof.hardware.description}")  # fmt: skip
    table = Table(title=f"Engines to meet TTFT {q} <= {result.slo.ttft_ms:g} ms and ITL {q} <= {result.slo.itl_ms:g} ms",
                  title_justify="left")  # fmt: skip
    for col in ("role", "engines", "predicted", "target", "load"):
        table.add_column(col, justify="left" if col == "role" else "right")
    p, d = result.prediction.prefill, result.prediction.decode
    kv = f", KV {d.utilization:.0%}" if prof.model.kv_capacity_tokens else ""
    table.add_row("prefill (P)", str(result.prefill_engines), f"TTFT {_lat(result.prediction.ttft_ms)}", f"{result.slo.ttft_ms:g} ms",
                  f"busy {p.utilization:.0%}")  # fmt: skip
    table.add_row("decode (D)", str(result.decode_engines), f"ITL {_lat(result.prediction.itl_ms)}", f"{result.slo.itl_ms:g} ms",
                  f"batch {d.mean_batch:,.1f}{kv}")  # fmt: skip
    console.print(table)
    if result.feasible:
        console.print(f"{result.prefill_engines}P{result.decode_engines}D; binding: {result.binding} ({result.binding_role})")
    else:
        console.print(f"[red]no plan[/]: {result.reason}")


def register(app: typer.Typer) -> None:
    app.command("plan", help=HELP)(plan)

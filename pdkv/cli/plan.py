"""`pdkv plan`: how many bytes one request's KV is, and how fast the link could move it."""

from __future__ import annotations

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

HELP = """Size the KV cache one request moves from prefill to decode.

Examples:

  pdkv plan --model ./Qwen3-8B --prompt-tokens 1000 --output-tokens 128

  pdkv plan --layers 36 --kv-heads 8 --head-dim 128 --dtype bfloat16 --prompt-tokens 1000 --json

  pdkv plan --model ./Qwen3-8B --tp 1:2     # P TP 1, D TP 2: what each P rank writes into each D rank
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
    prompt_tokens: int = typer.Option(1000, "--prompt-tokens", help="Prompt length in tokens."),
    output_tokens: int = typer.Option(0, "--output-tokens", help="Tokens D generates (for D's block count)."),
    tp: str = typer.Option("1", "--tp", help="Tensor-parallel size (sizes are per TP rank), or P:D for P and D of different sizes."),
    link_gbps: LinkGbpsOpt = 400.0,
    json_out: JsonOpt = False,
) -> None:
    import msgspec

    from pdkv.geometry import parse_tp_pair, plan_transfer, rank_transfers

    p_tp, d_tp = parse_tp_pair(tp)
    geometry = resolve_geometry(model, layers, kv_heads, head_dim, dtype, p_tp if p_tp == d_tp else 1)
    result = plan_transfer(
        geometry,
        prompt_tokens=prompt_tokens,
        block_size=block_size,
        output_tokens=output_tokens,
        link_gbps=link_gbps,
    )
    if p_tp != d_tp:
        ranks = rank_transfers(geometry, p_tp, d_tp, prompt_tokens=prompt_tokens, block_size=block_size)
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


def register(app: typer.Typer) -> None:
    app.command("plan", help=HELP)(plan)

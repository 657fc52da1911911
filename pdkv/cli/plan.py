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
    TpOpt,
    resolve_geometry,
)
from pdkv.cli.output import console, print_json

HELP = """Size the KV cache one request moves from prefill to decode.

Examples:

  pdkv plan --model ./Qwen3-8B --prompt-tokens 1000 --output-tokens 128

  pdkv plan --layers 36 --kv-heads 8 --head-dim 128 --dtype bfloat16 --prompt-tokens 1000 --json
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
    tp: TpOpt = 1,
    link_gbps: LinkGbpsOpt = 400.0,
    json_out: JsonOpt = False,
) -> None:
    from pdkv.geometry import plan_transfer

    geometry = resolve_geometry(model, layers, kv_heads, head_dim, dtype, tp)
    result = plan_transfer(
        geometry,
        prompt_tokens=prompt_tokens,
        block_size=block_size,
        output_tokens=output_tokens,
        link_gbps=link_gbps,
    )
    if json_out:
        print_json(result)
        return
    g = result.geometry
    table = Table(title="KV transfer plan (per TP rank)", show_header=True)
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


def register(app: typer.Typer) -> None:
    app.command("plan", help=HELP)(plan)

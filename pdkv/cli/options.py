"""Options several commands share, as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document for scripts instead of tables.")]
ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Model directory or its config.json.")]
LayersOpt = Annotated[int | None, typer.Option("--layers", help="Number of attention layers (instead of --model).")]
KvHeadsOpt = Annotated[int | None, typer.Option("--kv-heads", help="KV heads (instead of --model).")]
HeadDimOpt = Annotated[int | None, typer.Option("--head-dim", help="Head dimension (instead of --model).")]
DtypeOpt = Annotated[str | None, typer.Option("--dtype", help="KV cache dtype: bfloat16, float16, float32, fp8.")]
BlockSizeOpt = Annotated[int, typer.Option("--block-size", help="Tokens per KV block.")]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel size; sizes are per TP rank.")]
LinkGbpsOpt = Annotated[float, typer.Option("--link-gbps", help="Link rate in Gb/s for the transfer floor.")]


def resolve_geometry(
    model: str | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    dtype: str | None,
    tp: int = 1,
):
    """The KV geometry from --model or from explicit --layers --kv-heads --head-dim --dtype."""
    from pdkv.errors import UsageError
    from pdkv.geometry import dense_geometry, geometry_from_model

    explicit = (layers, kv_heads, head_dim)
    if model is not None:
        if any(v is not None for v in explicit):
            raise UsageError("give either --model or --layers/--kv-heads/--head-dim, not both")
        return geometry_from_model(model, tp=tp, dtype=dtype)
    if any(v is None for v in explicit):
        raise UsageError(
            "no model geometry given",
            hint="pass --model DIR, or all of --layers --kv-heads --head-dim (and --dtype)",
        )
    return dense_geometry(layers, kv_heads, head_dim, dtype or "bfloat16", tp=tp)  # type: ignore[arg-type]

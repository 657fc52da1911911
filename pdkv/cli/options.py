"""Options several commands share, as Annotated aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

AdminKeyOpt = Annotated[
    str | None,
    typer.Option("--admin-key", envvar="PDKV_ADMIN_KEY", show_envvar=True, help="The proxy's admin key, for its /pdkv/* and /metrics."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document for scripts instead of tables.")]
DEFAULT_LOG_DIR = Path(".pdkv/logs")
LogDirOpt = Annotated[Path, typer.Option("--log-dir", help="Where each part's log is written, and the record of what `pdkv up` started.")]
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
    from pdkv.geometry import geometry_from_options

    return geometry_from_options(model, layers, kv_heads, head_dim, dtype, tp)

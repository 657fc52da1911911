"""KV cache sizes from a model config: pure arithmetic, no I/O beyond reading config.json.

The reference figures (docs/timeline.md): for Qwen3-8B (36 layers, 8 KV heads,
head_dim 128, bf16) a token holds 147,456 B of KV, a 16-token block 2.25 MiB,
and a 1000-token prompt 63 blocks = 148,635,648 B, about 3 ms at 400 Gb/s.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import msgspec

from pdkv.errors import ConfigError, TransferError, UnsupportedModelError, UsageError
from pdkv.tp_heads import check_tp_pair, head_shares

DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

AttentionKind = Literal["dense", "mla"]


class KVGeometry(msgspec.Struct, frozen=True):
    """The KV cache shape of one TP rank.

    Dense attention stores K and V (`kv_factor` 2) of `kv_heads` heads of
    `head_dim`; MLA stores one latent of `head_dim` = kv_lora_rank +
    qk_rope_head_dim per token (`kv_factor` 1, `kv_heads` 1).
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int
    attention: AttentionKind = "dense"
    tp: int = 1

    @property
    def kv_factor(self) -> int:
        return 1 if self.attention == "mla" else 2

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.kv_factor * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.bytes_per_token_per_layer

    def block_bytes_per_layer(self, block_size: int) -> int:
        """Bytes of one block in one layer's region (K and V together), the unit a descriptor moves."""
        return block_size * self.bytes_per_token_per_layer

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.bytes_per_token


class RankTransfer(msgspec.Struct, frozen=True):
    """What one P rank writes into one D rank for one request, P and D of TP sizes that may differ."""

    p_rank: int
    d_rank: int
    heads: int  # KV heads of each block it writes (MLA: the one latent)
    bytes: int
    descriptors: int  # for contiguous blocks: one per layer when whole blocks move, else one per layer and block


class TransferSize(msgspec.Struct, frozen=True):
    """What one request moves from P to D, and the link's lower bound on it."""

    geometry: KVGeometry
    block_size: int
    prompt_tokens: int
    output_tokens: int
    link_gbps: float
    bytes_per_token: int
    bytes_per_block: int
    blocks: int
    full_blocks: int
    tail_tokens: int
    transfer_bytes: int
    floor_ms: float
    decode_blocks: int
    # P and D of different TP sizes: every (P rank, D rank) write, whose bytes add up to transfer_bytes (all ranks).
    ranks: list[RankTransfer] = []


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size) if tokens > 0 else 0


def size_transfer(
    geometry: KVGeometry,
    *,
    prompt_tokens: int,
    block_size: int = 16,
    output_tokens: int = 0,
    link_gbps: float = 400.0,
) -> TransferSize:
    """Size the KV that P pushes to D for one prompt (per TP rank)."""
    if block_size <= 0:
        raise UsageError(f"block size must be positive, got {block_size}")
    if prompt_tokens < 0 or output_tokens < 0:
        raise UsageError("token counts must not be negative")
    if link_gbps <= 0:
        raise UsageError(f"link rate must be positive, got {link_gbps} Gb/s")
    blocks = blocks_for(prompt_tokens, block_size)
    per_block = geometry.bytes_per_block(block_size)
    transfer = blocks * per_block
    return TransferSize(
        geometry=geometry,
        block_size=block_size,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        link_gbps=link_gbps,
        bytes_per_token=geometry.bytes_per_token,
        bytes_per_block=per_block,
        blocks=blocks,
        full_blocks=prompt_tokens // block_size,
        tail_tokens=prompt_tokens % block_size,
        transfer_bytes=transfer,
        floor_ms=transfer * 8 / (link_gbps * 1e9) * 1e3,
        decode_blocks=blocks_for(prompt_tokens + output_tokens, block_size),
    )


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype.lower().removeprefix("torch.")]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise UsageError(f"unknown dtype {dtype!r}", hint=f"use one of: {known}") from None


def split_kv_heads(kv_heads: int, tp: int) -> int:
    """KV heads one TP rank holds: split across ranks, replicated once TP exceeds them."""
    if tp <= 0:
        raise UsageError(f"--tp must be positive, got {tp}")
    if tp <= kv_heads:
        if kv_heads % tp:
            raise UsageError(f"{kv_heads} KV heads cannot be split evenly over TP {tp}")
        return kv_heads // tp
    if tp % kv_heads:
        raise UsageError(f"TP {tp} is not a multiple of the {kv_heads} KV heads it must replicate")
    return 1


def dense_geometry(layers: int, kv_heads: int, head_dim: int, dtype: str, tp: int = 1) -> KVGeometry:
    for name, value in (("layers", layers), ("kv-heads", kv_heads), ("head-dim", head_dim)):
        if value <= 0:
            raise UsageError(f"--{name} must be positive, got {value}")
    return KVGeometry(
        layers=layers,
        kv_heads=split_kv_heads(kv_heads, tp),
        head_dim=head_dim,
        dtype=dtype,
        dtype_bytes=dtype_bytes(dtype),
        tp=tp,
    )


def load_config(model: str | Path) -> dict[str, Any]:
    """Read a model directory's config.json (or the file itself)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"no model config at {path}", hint="pass a model directory or its config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    # Multimodal wrappers keep the language model's fields under text_config.
    text = data.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:
        merged = dict(data)
        merged.update(text)
        return merged
    return data


def _field(config: dict[str, Any], name: str) -> int:
    value = config.get(name)
    if value is None:
        raise ConfigError(f"model config has no {name!r}", hint="pass --layers --kv-heads --head-dim --dtype instead")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"model config field {name!r} must be a positive integer, got {value!r}")
    return value


def _refuse_unsupported(config: dict[str, Any]) -> None:
    model_type = str(config.get("model_type", ""))
    hybrid_markers = ("mamba", "ssm", "jamba", "rwkv", "falcon_h1", "nemotron_h", "qwen3_next", "granitemoehybrid")
    if any(marker in model_type for marker in hybrid_markers) or any(
        key in config for key in ("ssm_cfg", "mamba_d_state", "layers_block_type", "hybrid_override_pattern", "linear_attn_config")
    ):
        raise UnsupportedModelError(
            f"model type {model_type or '?'} has hybrid / Mamba (state-space) layers, whose state pdkv cannot size per token",
            hint="only full-attention (dense or MLA) models are supported",
        )
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        other = sorted({str(t) for t in layer_types if t != "full_attention"})
        if other:
            raise UnsupportedModelError(
                f"model mixes layer types {', '.join(other)} with full attention; pdkv sizes full-attention layers only",
                hint="sliding-window and linear-attention layers are not supported",
            )
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) is not False:
        max_pos = config.get("max_position_embeddings")
        if not (isinstance(max_pos, int) and isinstance(window, int) and window >= max_pos):
            raise UnsupportedModelError(
                f"model uses sliding-window attention (window {window}); its KV per request is not prompt-sized",
                hint="sliding-window models are not supported",
            )


def geometry_from_config(config: dict[str, Any], *, tp: int = 1, dtype: str | None = None) -> KVGeometry:
    """KV geometry of one TP rank from a Hugging Face config dict.

    Raises UnsupportedModelError for layouts pdkv cannot size (sliding window,
    hybrid / Mamba), ConfigError for missing or ill-typed fields.
    """
    _refuse_unsupported(config)
    layers = _field(config, "num_hidden_layers")
    dtype = dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    size = dtype_bytes(dtype)
    if config.get("kv_lora_rank"):
        latent = _field(config, "kv_lora_rank") + _field(config, "qk_rope_head_dim")
        if tp <= 0:
            raise UsageError(f"--tp must be positive, got {tp}")
        # MLA's latent is not split by head: every TP rank holds all of it.
        return KVGeometry(layers=layers, kv_heads=1, head_dim=latent, dtype=dtype, dtype_bytes=size, attention="mla", tp=tp)
    heads = _field(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        raise ConfigError(f"model config field 'num_key_value_heads' must be a positive integer, got {kv_heads!r}")
    head_dim = config.get("head_dim")
    if head_dim is None:
        head_dim = _field(config, "hidden_size") // heads
    elif not isinstance(head_dim, int) or head_dim <= 0:
        raise ConfigError(f"model config field 'head_dim' must be a positive integer, got {head_dim!r}")
    return KVGeometry(
        layers=layers,
        kv_heads=split_kv_heads(kv_heads, tp),
        head_dim=head_dim,
        dtype=dtype,
        dtype_bytes=size,
        tp=tp,
    )


def geometry_from_options(
    model: str | Path | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    dtype: str | None,
    tp: int = 1,
) -> KVGeometry:
    """The KV geometry from --model, or from explicit --layers --kv-heads --head-dim (and --dtype); one or the other."""
    explicit = (layers, kv_heads, head_dim)
    if model is not None:
        if any(v is not None for v in explicit):
            raise UsageError("give either --model or --layers/--kv-heads/--head-dim, not both")
        return geometry_from_model(model, tp=tp, dtype=dtype)
    if layers is None or kv_heads is None or head_dim is None:
        raise UsageError(
            "no model geometry given",
            hint="pass --model DIR, or all of --layers --kv-heads --head-dim (and --dtype)",
        )
    return dense_geometry(layers, kv_heads, head_dim, dtype or "bfloat16", tp=tp)


def geometry_from_model(model: str | Path, *, tp: int = 1, dtype: str | None = None) -> KVGeometry:
    return geometry_from_config(load_config(model), tp=tp, dtype=dtype)


def parse_tp_pair(text: str) -> tuple[int, int]:
    """`--tp N` (P and D alike) or `--tp P:D` -> (P's TP, D's TP); UsageError for anything else or sizes that do
    not divide each other."""

    p, sep, d = text.partition(":")
    try:
        pair = (int(p), int(d) if sep else int(p))
    except ValueError:
        raise UsageError(f"--tp {text!r} is not a TP size or a P:D pair", hint="write --tp 2, or --tp 1:2 for P TP 1 and D TP 2") from None
    why = check_tp_pair(*pair)
    if why is not None:
        raise UsageError(why, hint="use TP sizes where one divides the other")
    return pair


def rank_transfers(geometry: KVGeometry, p_tp: int, d_tp: int, *, prompt_tokens: int, block_size: int) -> list[RankTransfer]:
    """Every (P rank, D rank) write of one prompt, from the whole model's `geometry` (tp 1), in the layout pdkv's
    connector moves (LBHNC: one region per layer, each block's heads one after another, K and V inside each head).
    Dense heads split as pdkv.tp_heads.head_shares says; MLA's latent is whole on every rank, and each D
    rank takes it from one P rank. Pure."""

    blocks = blocks_for(prompt_tokens, block_size)
    per_layer = geometry.block_bytes_per_layer(block_size)  # one block of one layer, every head
    out: list[RankTransfer] = []
    for d_rank in range(d_tp):
        if geometry.attention == "mla":
            shares = {d_rank * p_tp // d_tp if d_tp >= p_tp else d_rank: None}
        else:
            try:
                shares = head_shares(geometry.kv_heads, p_tp, d_tp, d_rank)
            except TransferError as exc:
                raise UsageError(str(exc), hint="use TP sizes that split the model's KV heads") from None
        for p_rank, share in shares.items():
            heads = geometry.kv_heads if share is None else share.count
            whole = share is None or share.whole
            out.append(RankTransfer(
                p_rank=p_rank, d_rank=d_rank, heads=heads, bytes=blocks * geometry.layers * per_layer * heads // geometry.kv_heads,
                descriptors=geometry.layers * (1 if whole or not blocks else blocks),
            ))
    return out

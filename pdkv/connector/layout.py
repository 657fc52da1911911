"""vLLM's per-layer KV tensors -> transport Regions, and the start-up refusals.

vLLM 0.32 views every attention layer's cache as a 4-D `[B, H, N, C]`
tensor in the LBHNC layout (layer outermost, then block; each block's
heads x tokens x content contiguous): one region per layer whose block b
is `stride(0)` bytes apart. vLLM 0.26 has no LBHNC; its HND gives the same
dense pages (`kv_layout_for` picks the name). Older layouts keep K and V apart as
`[2, B, ...]`: two regions per layer. Anything else is refused, never
guessed. `TensorInfo` carries only numbers, so this module is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from pdkv.errors import UnsupportedModelError
from pdkv.wire import Region


@dataclass(frozen=True)
class TensorInfo:
    name: str
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements
    element_size: int

    @classmethod
    def of(cls, name: str, t: object) -> TensorInfo:
        return cls(name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())  # type: ignore[attr-defined]


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True when a tensor of `shape` with `stride` (elements) covers one contiguous run."""
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def kv_layout_for(known_layouts: frozenset[str]) -> str:
    """The KV cache layout to ask of a vLLM that knows `known_layouts`: LBHNC, or its older name HND.

    Both put each block's heads x tokens x content in one dense page per layer, what `regions_for_layer`
    reads; NHD (tokens outside heads) is what pdkv never asks for. Pure.
    """
    if "LBHNC" in known_layouts:
        return "LBHNC"
    if "HND" in known_layouts:
        return "HND"
    raise UnsupportedModelError(
        f"this vLLM knows the KV cache layouts {sorted(known_layouts)}, none of them LBHNC or HND",
        hint="pdkv's connector supports vLLM 0.26 to 0.33",
    )


def regions_for_layer(t: TensorInfo, num_blocks: int) -> list[Region]:
    """The regions of one layer's cache; raise UnsupportedModelError for a layout pdkv cannot move."""
    es = t.element_size
    if len(t.shape) >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks and num_blocks != 2:
        # [2, B, ...]: K and V apart.
        inner_shape, inner_stride = t.shape[2:], t.stride[2:]
        if not _dense(inner_shape, inner_stride) or t.stride[1] != prod(inner_shape):
            raise UnsupportedModelError(f"{t.name}: KV blocks are not dense pages (shape {t.shape}, stride {t.stride})")
        block_len = t.stride[1] * es
        return [Region(t.data_ptr + kv * t.stride[0] * es, block_len, num_blocks) for kv in range(2)]
    if len(t.shape) >= 2 and t.shape[0] == num_blocks:
        inner_shape, inner_stride = t.shape[1:], t.stride[1:]
        if not _dense(inner_shape, inner_stride) or t.stride[0] != prod(inner_shape):
            raise UnsupportedModelError(
                f"{t.name}: KV blocks are not dense pages (shape {t.shape}, stride {t.stride})",
                hint="use the LBHNC KV cache layout (pdkv's connector asks vLLM for it)",
            )
        return [Region(t.data_ptr, t.stride[0] * es, num_blocks)]
    raise UnsupportedModelError(f"{t.name}: cannot find {num_blocks} blocks in a KV tensor of shape {t.shape}")


def regions_for_caches(tensors: Sequence[TensorInfo], num_blocks: int) -> list[Region]:
    """Regions of every layer, in the given (layer) order; layers sharing one cache count once."""
    out: list[Region] = []
    seen: set[tuple[int, int]] = set()
    for t in tensors:
        for r in regions_for_layer(t, num_blocks):
            if (r.base, r.block_len) in seen:
                continue
            seen.add((r.base, r.block_len))
            out.append(r)
    if not out:
        raise UnsupportedModelError("no KV cache tensors to transfer")
    return out


def layer_regions(
    tensors: Sequence[TensorInfo], num_blocks: int, regions: Sequence[Region],
) -> tuple[dict[str, int], list[tuple[int, ...]]]:
    """({layer name: its layer index}, [the indices into `regions` of each layer]), for writing layer by layer.

    `regions` is regions_for_caches(tensors, num_blocks). Layers that share one cache (its regions counted once there)
    share one index: the cache is ready once the first of them has written it. Indices follow `tensors`' order."""
    at = {(r.base, r.block_len): i for i, r in enumerate(regions)}
    index: dict[tuple[int, ...], int] = {}
    of_name: dict[str, int] = {}
    for t in tensors:
        mine = tuple(at[(r.base, r.block_len)] for r in regions_for_layer(t, num_blocks))
        of_name[t.name] = index.setdefault(mine, len(index))
    return of_name, list(index)


def memory_ranges(regions: Sequence[Region]) -> list[tuple[int, int]]:
    """Merge regions into the fewest (address, length) ranges to register with the transport."""
    spans = sorted((r.base, r.base + r.size) for r in regions)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]


def refusal(
    *,
    use_mla: bool,
    kv_groups: int,
    sliding_window: bool,
    spec_names: Sequence[str] = (),
) -> str | None:
    """Why pdkv's connector must refuse this model at start-up, or None. Pure."""
    if use_mla:
        return "MLA attention is not supported by pdkv's connector (dense attention only)"
    if kv_groups != 1:
        return f"hybrid models ({kv_groups} KV cache groups: {', '.join(spec_names)}) are not supported by pdkv's connector"
    if sliding_window:
        return "sliding-window attention is not supported by pdkv's connector"
    return None

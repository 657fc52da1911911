"""What a benchmark case moves and how its timings read: block ids per layout, sweeps, statistics. Pure.

Layouts, for `n` blocks (P and D of different TP sizes: D rank 0's share of each block from each P rank):

    contiguous  P blocks 0..n-1 into D blocks 0..n-1: one descriptor per layer
    per-block   the same blocks, one descriptor per block per layer (no coalescing)
    scattered   seeded random, pairwise non-adjacent ids on both sides, in random
                order: nothing coalesces, like a fragmented cache
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal

import msgspec

from pdkv.errors import UsageError
from pdkv.geometry import KVGeometry, size_transfer, rank_transfers
from pdkv.tp_heads import HeadShare, head_shares, rank_heads

Layout = Literal["contiguous", "per-block", "scattered"]
LAYOUTS: tuple[Layout, ...] = ("contiguous", "per-block", "scattered")

# Scattered ids are drawn from 3n slots so that they are non-adjacent yet still random.
SCATTER_SPREAD = 3


def blocks_needed(layout: str, blocks: int) -> int:
    """Blocks each side's regions must hold for `blocks` blocks in `layout`."""
    return blocks * SCATTER_SPREAD if layout == "scattered" else blocks


def coalesces(layout: str) -> bool:
    return layout == "contiguous"


def _non_adjacent(n: int, slots: int, rng: random.Random) -> list[int]:
    # Choosing n sorted values c_i from slots-n+1 and taking c_i + i leaves a gap of at least one between ids.
    picks = sorted(rng.sample(range(slots - n + 1), n))
    ids = [c + i for i, c in enumerate(picks)]
    rng.shuffle(ids)
    return ids


def block_ids(layout: str, blocks: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(P block ids, D block ids) for `blocks` blocks in `layout`; all ids lie below blocks_needed()."""
    check_layout(layout)
    if blocks <= 0:
        raise UsageError(f"--blocks must be positive, got {blocks}")
    if layout != "scattered":
        ids = list(range(blocks))
        return ids, list(ids)
    rng = random.Random(seed)
    slots = blocks_needed(layout, blocks)
    return _non_adjacent(blocks, slots, rng), _non_adjacent(blocks, slots, rng)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}", hint=f"use one of: {', '.join(LAYOUTS)}")


def expand_layouts(layouts: Sequence[str]) -> list[str]:
    """Layouts in the order given, "all" standing for every layout, duplicates dropped."""
    out: list[str] = []
    for item in layouts:
        for name in item.split(","):
            name = name.strip()
            for one in LAYOUTS if name == "all" else (name,):
                check_layout(one)
                if one not in out:
                    out.append(one)
    return out or ["contiguous"]


def parse_sweep(items: Sequence[str]) -> dict[str, list]:
    """`--sweep blocks=1,16,63 --sweep layout=contiguous,scattered` -> {"blocks": [...], "layout": [...]}."""
    out: dict[str, list] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not values.strip():
            raise UsageError(f"cannot read --sweep {item!r}", hint="write it as blocks=1,16,63,256 or layout=all")
        parts = [v.strip() for v in values.split(",") if v.strip()]
        if key == "blocks":
            try:
                nums = [int(v) for v in parts]
            except ValueError:
                raise UsageError(f"--sweep blocks takes integers, got {values!r}") from None
            if any(n <= 0 for n in nums):
                raise UsageError("--sweep blocks must be positive")
            out["blocks"] = nums
        elif key in ("layout", "layouts"):
            out["layout"] = expand_layouts(parts)
        else:
            raise UsageError(f"--sweep cannot vary {key!r}", hint="sweep blocks or layout")
    return out


class Timing(msgspec.Struct, frozen=True):
    """Transfer times of one case, in ms, and what they mean for its bytes and the link."""

    iters: int
    min_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    gbps_p50: float
    gbps_run: float
    link_pct_p50: float


def percentile(sorted_ms: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of already sorted values."""
    if not sorted_ms:
        raise ValueError("no samples")
    pos = (len(sorted_ms) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


def gbytes_per_s(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else math.inf


def summarize(samples_ms: Sequence[float], nbytes: int, link_gbps: float) -> Timing:
    """Statistics of the timed transfers; GB/s is decimal (1e9 B/s), the link rate Gb/s (1e9 bit/s)."""
    s = sorted(samples_ms)
    p50 = percentile(s, 50)
    total_ms = sum(s)
    gbps_p50 = gbytes_per_s(nbytes, p50)
    return Timing(
        iters=len(s),
        min_ms=s[0],
        p50_ms=p50,
        p90_ms=percentile(s, 90),
        p99_ms=percentile(s, 99),
        max_ms=s[-1],
        mean_ms=total_ms / len(s),
        gbps_p50=gbps_p50,
        gbps_run=gbytes_per_s(nbytes * len(s), total_ms),
        link_pct_p50=100 * gbps_p50 * 8 / link_gbps,
    )


def tp_layout(g: KVGeometry, block_size: int, p_tp: int, d_tp: int) -> tuple[dict[int, HeadShare] | None, int, int]:
    """(shares, P's block length, D's block length) of one layer: for P and D of different TP sizes (`g` the whole
    model) {P rank: its share of D rank 0's heads} and each rank's bytes of a block; for equal TP (None, both whole)."""
    whole = g.block_bytes_per_layer(block_size)
    if p_tp == d_tp:
        return None, whole, whole
    unit = whole // g.kv_heads
    return head_shares(g.kv_heads, p_tp, d_tp, 0), unit * rank_heads(g.kv_heads, p_tp, 0)[1], unit * rank_heads(g.kv_heads, d_tp, 0)[1]


def case_plan_bytes(g: KVGeometry, tp: tuple[int, int], block_size: int, blocks: int) -> int:
    """`pdkv plan`'s bytes for a case: the prompt's, or (TP sizes differ) what D rank 0 receives from all P ranks."""
    tokens = blocks * block_size
    if tp[0] == tp[1]:
        return size_transfer(g, prompt_tokens=tokens, block_size=block_size).transfer_bytes
    return sum(r.bytes for r in rank_transfers(g, *tp, prompt_tokens=tokens, block_size=block_size) if r.d_rank == 0)

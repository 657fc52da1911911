from __future__ import annotations

import random

import pytest

from pdkv.bench.layout import (
    LAYOUTS,
    block_ids,
    blocks_needed,
    coalesces,
    expand_layouts,
    parse_sweep,
    percentile,
    summarize,
)
from pdkv.bench.runner import BenchSpec, link_rate
from pdkv.errors import UsageError
from pdkv.geometry import dense_geometry, size_transfer
from pdkv.transport import plan_descriptors
from pdkv.wire import Region

QWEN3_8B = dense_geometry(36, 8, 128, "bfloat16")


def regions(base: int, num_blocks: int, block_len: int, layers: int) -> list[Region]:
    return [Region(base + i * num_blocks * block_len, block_len, num_blocks) for i in range(layers)]


@pytest.mark.parametrize(("layout", "descriptors"), [("contiguous", 36), ("per-block", 2268), ("scattered", 2268)])
def test_qwen3_8b_63_blocks(layout, descriptors):
    bl = QWEN3_8B.block_bytes_per_layer(16)
    assert bl == 65536
    nb = blocks_needed(layout, 63)
    local, remote = block_ids(layout, 63, seed=3)
    ds = plan_descriptors(local, remote, regions(0, nb, bl, 36), regions(1 << 40, nb, bl, 36), coalesce=coalesces(layout))
    assert len(ds) == descriptors
    assert sum(d.length for d in ds) == size_transfer(QWEN3_8B, prompt_tokens=63 * 16).transfer_bytes == 148635648


def test_contiguous_and_per_block_use_the_same_ids():
    assert block_ids("contiguous", 5) == ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    assert block_ids("per-block", 5) == block_ids("contiguous", 5)
    assert blocks_needed("per-block", 5) == 5


@pytest.mark.parametrize("n", [1, 2, 17, 63, 256])
def test_scattered_ids_are_non_adjacent_distinct_and_in_range(n):
    local, remote = block_ids("scattered", n, seed=n)
    for ids in (local, remote):
        assert len(ids) == len(set(ids)) == n
        s = sorted(ids)
        assert all(b - a >= 2 for a, b in zip(s, s[1:], strict=False))
        assert 0 <= s[0] and s[-1] < blocks_needed("scattered", n)


def test_scattered_is_seeded_and_random():
    assert block_ids("scattered", 63, seed=1) == block_ids("scattered", 63, seed=1)
    assert block_ids("scattered", 63, seed=1) != block_ids("scattered", 63, seed=2)
    local, remote = block_ids("scattered", 63, seed=1)
    assert local != remote and local != sorted(local)


def test_bad_layouts_and_counts_are_usage_errors():
    with pytest.raises(UsageError, match="unknown layout"):
        block_ids("diagonal", 4)
    with pytest.raises(UsageError, match="positive"):
        block_ids("contiguous", 0)


def test_expand_layouts():
    assert expand_layouts(["all"]) == list(LAYOUTS)
    assert expand_layouts(["scattered", "contiguous,scattered"]) == ["scattered", "contiguous"]
    assert expand_layouts([]) == ["contiguous"]
    with pytest.raises(UsageError):
        expand_layouts(["nope"])


def test_parse_sweep():
    assert parse_sweep(["blocks=1,16,63,256"]) == {"blocks": [1, 16, 63, 256]}
    assert parse_sweep(["blocks=4", "layout=all"]) == {"blocks": [4], "layout": list(LAYOUTS)}
    for bad in ("blocks", "blocks=", "blocks=a,b", "blocks=0", "iters=3"):
        with pytest.raises(UsageError):
            parse_sweep([bad])


def test_percentile_interpolates_like_the_textbook():
    values = sorted(random.Random(0).uniform(1, 100) for _ in range(37))
    assert percentile(values, 0) == values[0] and percentile(values, 100) == values[-1]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)


def test_summarize_rates():
    t = summarize([2.0, 1.0, 4.0, 3.0], nbytes=10**9, link_gbps=400)
    assert (t.min_ms, t.max_ms, t.iters) == (1.0, 4.0, 4)
    assert t.p50_ms == 2.5
    assert t.gbps_p50 == pytest.approx(400.0)  # 1 GB in 2.5 ms
    assert t.gbps_run == pytest.approx(4 / 0.010)  # 4 GB in 10 ms
    assert t.link_pct_p50 == pytest.approx(800.0)  # 400 GB/s is 3200 Gb/s, 8x a 400 Gb/s link


def test_link_rate_sources():
    assert link_rate(BenchSpec(QWEN3_8B, link_gbps=200)) == (200, "--link-gbps")
    assert link_rate(BenchSpec(QWEN3_8B)) == (400.0, "default")
    with pytest.raises(UsageError):
        link_rate(BenchSpec(QWEN3_8B, link_gbps=0))

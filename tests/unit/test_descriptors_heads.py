"""Heterogeneous TP planning: which P ranks a D rank reads, and the sub-block descriptors, checked against memory.

Each case lays out P's and D's KV regions in bytearrays, fills every P rank's heads with bytes that name
(region, block, global head), applies the planned descriptors, and checks every D rank holds exactly its heads
in the paired blocks and nothing else was written.
"""

from __future__ import annotations

import pytest

from pdkv.errors import TransferError
from pdkv.tp_heads import HeadShare, check_tp_pair, head_shares, pullers, rank_heads
from pdkv.transport import plan_descriptors
from pdkv.wire import Region

UNIT = 48  # bytes of one head in one block (K and V of it), small so the bytes are checkable


def test_rank_heads_split_and_replicate():
    assert [rank_heads(8, 2, r) for r in range(2)] == [(0, 4), (4, 4)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(TransferError, match="split evenly"):
        rank_heads(6, 4, 0)
    with pytest.raises(TransferError, match="multiple"):
        rank_heads(2, 3, 0)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "d_rank", "expected"),
    [
        (1, 2, 0, {0: HeadShare(0, 0, 4, 8, 4)}),
        (1, 2, 1, {0: HeadShare(4, 0, 4, 8, 4)}),
        (2, 1, 0, {0: HeadShare(0, 0, 4, 4, 8), 1: HeadShare(0, 4, 4, 4, 8)}),
        (1, 4, 3, {0: HeadShare(6, 0, 2, 8, 2)}),
        (4, 2, 1, {2: HeadShare(0, 0, 2, 2, 4), 3: HeadShare(0, 2, 2, 2, 4)}),
        (2, 2, 1, {1: HeadShare(0, 0, 4, 4, 4)}),
    ],
)
def test_head_shares(p_tp, d_tp, d_rank, expected):
    assert head_shares(8, p_tp, d_tp, d_rank) == expected


def test_replicated_heads_come_from_the_first_rank_holding_them():
    # 2 KV heads: P TP 4 holds head 0 on ranks 0-1 and head 1 on ranks 2-3; D TP 1 needs both.
    assert head_shares(2, 4, 1, 0) == {0: HeadShare(0, 0, 1, 1, 2), 2: HeadShare(0, 1, 1, 1, 2)}
    assert [pullers(2, 4, 1, r) for r in range(4)] == [1, 0, 1, 0]
    # P TP 1, D TP 4: every D rank reads its one head from P rank 0.
    assert pullers(2, 1, 4, 0) == 4
    assert head_shares(2, 1, 4, 3) == {0: HeadShare(1, 0, 1, 2, 1)}


def test_pullers():
    assert pullers(8, 1, 2, 0) == 2
    assert [pullers(8, 2, 1, r) for r in range(2)] == [1, 1]
    assert [pullers(8, 4, 2, r) for r in range(4)] == [1, 1, 1, 1]


def test_tp_sizes_that_do_not_divide_are_refused():
    assert check_tp_pair(2, 3) is not None and "divide" in check_tp_pair(2, 3)
    assert check_tp_pair(4, 2) is None
    with pytest.raises(TransferError, match="divide"):
        head_shares(12, 2, 3, 0)


class Side:
    """One TP rank's KV memory: `regions_per_layer` regions per layer (1: K and V inside each head, LBHNC; 2: K and
    V apart) of `num_blocks` blocks of `heads` heads, in one bytearray based at `base`."""

    def __init__(self, base: int, layers: int, regions_per_layer: int, num_blocks: int, heads: int) -> None:
        self.base, self.heads, self.num_blocks = base, heads, num_blocks
        block_len = heads * UNIT
        n = layers * regions_per_layer
        self.regions = [Region(base + i * num_blocks * block_len, block_len, num_blocks) for i in range(n)]
        self.mem = bytearray(n * num_blocks * block_len)

    def fill(self, first_head: int) -> None:
        for i, r in enumerate(self.regions):
            for b in range(r.num_blocks):
                for h in range(self.heads):
                    self.head(i, b, h)[:] = _pattern(i, b, first_head + h)

    def head(self, region: int, block: int, head: int) -> memoryview:
        r = self.regions[region]
        at = r.base - self.base + block * r.block_len + head * UNIT
        return memoryview(self.mem)[at : at + UNIT]


def _pattern(region: int, block: int, head: int) -> bytes:
    return bytes((region * 31 + block * 7 + head * 3 + k) % 251 for k in range(UNIT))


def _apply(descriptors, src: Side, dst: Side) -> None:
    for d in descriptors:
        s, t = d.src - src.base, d.dst - dst.base
        assert 0 <= s and s + d.length <= len(src.mem)
        assert 0 <= t and t + d.length <= len(dst.mem)
        dst.mem[t : t + d.length] = src.mem[s : s + d.length]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (1, 4), (4, 2), (2, 4), (2, 2)])
@pytest.mark.parametrize("regions_per_layer", [1, 2], ids=["kv-in-head", "k-and-v-apart"])
def test_every_d_rank_holds_exactly_its_heads(p_tp, d_tp, regions_per_layer):
    total, layers, nb = 8, 3, 12
    # Odd runs: a run of 3, a jump, a single block, a run of 2 going the other way on D's side.
    p_blocks = [0, 1, 2, 7, 9, 10]
    d_blocks = [5, 6, 7, 0, 11, 3]
    ps = []
    for r in range(p_tp):
        first, count = rank_heads(total, p_tp, r)
        side = Side((r + 1) << 32, layers, regions_per_layer, nb, count)
        side.fill(first)
        ps.append(side)
    for dr in range(d_tp):
        d_first, d_count = rank_heads(total, d_tp, dr)
        d = Side((dr + 100) << 32, layers, regions_per_layer, nb, d_count)
        shares = head_shares(total, p_tp, d_tp, dr)
        moved = 0
        for pr, share in shares.items():
            ds = plan_descriptors(p_blocks, d_blocks, ps[pr].regions, d.regions, heads=share)
            if not share.whole:
                assert len(ds) == len(d.regions) * len(p_blocks)  # one per (region, block)
            moved += sum(x.length for x in ds)
            _apply(ds, ps[pr], d)
        assert moved == len(d.regions) * len(p_blocks) * d_count * UNIT
        for i in range(len(d.regions)):
            for b in range(nb):
                for h in range(d_count):
                    got = bytes(d.head(i, b, h))
                    if b in d_blocks:
                        assert got == _pattern(i, p_blocks[d_blocks.index(b)], d_first + h), (i, b, h)
                    else:
                        assert got == bytes(UNIT), "a block D did not ask for was written"


def test_whole_share_coalesces_like_equal_tp():
    p = Side(1 << 32, 2, 1, 8, 4)
    d = Side(2 << 32, 2, 1, 8, 4)
    ds = plan_descriptors([0, 1, 2], [3, 4, 5], p.regions, d.regions, heads=HeadShare(0, 0, 4, 4, 4))
    assert len(ds) == 2 and ds[0].length == 3 * 4 * UNIT


@pytest.mark.parametrize(
    ("share", "p_heads", "d_heads", "match"),
    [
        (HeadShare(2, 0, 4, 4, 4), 4, 4, "leave a block"),  # P's heads 2..5 of 4
        (HeadShare(0, 1, 4, 4, 4), 4, 4, "leave a block"),  # into D's heads 1..4 of 4
        (HeadShare(0, 0, 2, 4, 2), 4, 3, "one head is"),  # D's block is 3 heads' worth: heads differ in size
        (HeadShare(0, 0, 0, 4, 2), 4, 2, "empty"),
        (HeadShare(0, 0, 1, 5, 2), 4, 2, "equal size"),  # P's block of 4 heads' bytes read as 5 heads
    ],
)
def test_shares_that_would_leave_a_block_are_refused(share, p_heads, d_heads, match):
    p = Side(1 << 32, 1, 1, 4, p_heads)
    d = Side(2 << 32, 1, 1, 4, d_heads)
    with pytest.raises(TransferError, match=match):
        plan_descriptors([0], [0], p.regions, d.regions, heads=share)


def test_block_ids_outside_the_regions_are_refused_with_a_share():
    p = Side(1 << 32, 1, 1, 4, 4)
    d = Side(2 << 32, 1, 1, 4, 2)
    share = HeadShare(2, 0, 2, 4, 2)
    with pytest.raises(TransferError, match="outside"):
        plan_descriptors([0], [4], p.regions, d.regions, heads=share)
    with pytest.raises(TransferError, match="repeat"):
        plan_descriptors([0, 1], [1, 1], p.regions, d.regions, heads=share)

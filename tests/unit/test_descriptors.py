from __future__ import annotations

import pytest

from pdkv.errors import TransferError
from pdkv.transport import Descriptor, plan_descriptors
from pdkv.transport.descriptors import block_runs
from pdkv.wire import Region

BL = 64 * 1024  # Qwen3-8B: one layer, one 16-token block


def regions(n_layers: int, base: int, num_blocks: int = 256, block_len: int = BL) -> list[Region]:
    return [Region(base + i * num_blocks * block_len, block_len, num_blocks) for i in range(n_layers)]


def test_seed_contiguous_is_one_descriptor_per_layer():
    blocks = list(range(63))
    ds = plan_descriptors(blocks, list(range(100, 163)), regions(36, 0), regions(36, 1 << 40))
    assert len(ds) == 36
    assert sum(d.length for d in ds) == 148635648
    assert ds[0] == Descriptor(0, (1 << 40) + 100 * BL, 63 * BL)


def test_per_block_without_coalescing_is_2268():
    ds = plan_descriptors(list(range(63)), list(range(63)), regions(36, 0), regions(36, 0), coalesce=False)
    assert len(ds) == 2268
    assert sum(d.length for d in ds) == 148635648


def test_runs_break_when_either_side_jumps():
    assert block_runs([1, 2, 3, 7, 8], [10, 11, 12, 13, 14]) == [(1, 10, 3), (7, 13, 2)]
    assert block_runs([1, 2, 3], [5, 9, 10]) == [(1, 5, 1), (2, 9, 2)]
    assert block_runs([4, 3], [0, 1]) == [(4, 0, 1), (3, 1, 1)]
    assert block_runs([], []) == []


def test_mixed_runs_address_arithmetic():
    lr, rr = [Region(1000, 10, 20)], [Region(5000, 10, 30)]
    ds = plan_descriptors([0, 1, 5, 6, 7, 19], [3, 4, 20, 21, 22, 0], lr, rr)
    assert ds == [Descriptor(1000, 5030, 20), Descriptor(1050, 5200, 30), Descriptor(1190, 5000, 10)]


@pytest.mark.parametrize(("local", "remote"), [([0, 20], [0, 1]), ([0, 1], [0, 30]), ([-1], [0]), ([0], [True])])
def test_out_of_range_block_ids_are_refused(local, remote):
    with pytest.raises(TransferError, match="outside"):
        plan_descriptors(local, remote, [Region(0, 10, 20)], [Region(0, 10, 30)])


def test_mismatched_shapes_are_refused():
    with pytest.raises(TransferError, match="pair"):
        plan_descriptors([0, 1], [0], [Region(0, 10, 4)], [Region(0, 10, 4)])
    with pytest.raises(TransferError, match="regions"):
        plan_descriptors([0], [0], [Region(0, 10, 4)], [])
    with pytest.raises(TransferError, match="block length"):
        plan_descriptors([0], [0], [Region(0, 10, 4)], [Region(0, 20, 4)])

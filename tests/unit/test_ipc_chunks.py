"""The CUDA IPC transport's pure parts: handle messages, bounds, translation, chunking."""

from __future__ import annotations

import msgspec
import pytest

from pdkv.errors import TransferError
from pdkv.transport import Descriptor, plan_descriptors
from pdkv.transport.ipc_chunks import SpanMap, plan_chunks
from pdkv.wire import IpcAllocation, IpcExport, IpcRegion, Region

KIB = 1024


def test_export_round_trips_over_msgpack():
    export = IpcExport("host/boot", 42, 1, "GPU-x", [IpcAllocation(b"\x01" * 64, 0x1000, 1 << 20)], [IpcRegion(0, 0x2000, 4096)], 1234)
    raw = msgspec.msgpack.encode(export)
    assert msgspec.msgpack.decode(raw, type=IpcExport) == export
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"host_id": 1}), type=IpcExport)


def test_translation_maps_into_the_opened_allocation():
    remote = SpanMap([(0x10_0000, 0x20_0000, 0x7F00_0000)])
    assert remote.translate(0x10_0010, 16, "remote") == 0x7F00_0010


@pytest.mark.parametrize(("addr", "length"), [(0x0F_FFF0, 32), (0x1F_FFF0, 32), (0x30_0000, 16), (0x10_0000, 0)])
def test_ranges_leaving_the_regions_are_refused(addr, length):
    remote = SpanMap([(0x10_0000, 0x20_0000, 0x7F00_0000)])
    with pytest.raises(TransferError, match="outside"):
        remote.translate(addr, length, "remote")


def test_overlapping_regions_are_refused():
    with pytest.raises(TransferError, match="overlap"):
        SpanMap([(0, 100, 0), (50, 150, 50)])


def test_chunks_cover_every_byte_once_for_per_block_and_contiguous():
    bl = 64 * KIB
    local = [Region(0x1000_0000 + i * 512 * bl, bl, 512) for i in range(36)]
    remote = [Region(0x9000_0000_0000 + i * 512 * bl, bl, 512) for i in range(36)]
    lmap = SpanMap([(r.base, r.base + r.size, r.base) for r in local])
    rmap = SpanMap([(r.base, r.base + r.size, r.base - 0x8000_0000_0000) for r in remote])
    for coalesce in (True, False):
        ds = plan_descriptors(list(range(63)), list(range(100, 163)), local, remote, coalesce=coalesce)
        chunks = plan_chunks(ds, lmap, rmap, chunk=bl)
        assert int(chunks[:, 2].sum()) == 148635648
        assert len(chunks) == 2268
        assert int(chunks[0, 1]) == remote[0].base - 0x8000_0000_0000 + 100 * bl
        # Every destination byte is written once: chunks do not overlap.
        starts = sorted(int(x) for x in chunks[:, 1])
        assert all(b - a >= bl for a, b in zip(starts, starts[1:]))


def test_long_descriptors_split_with_a_short_tail():
    m = SpanMap([(0, 1 << 20, 0)])
    chunks = plan_chunks([Descriptor(0, 4096, 10_000 - 10_000 % 16)], m, SpanMap([(0, 1 << 20, 1 << 30)]), chunk=4096)
    assert chunks.tolist() == [[0, (1 << 30) + 4096, 4096], [4096, (1 << 30) + 8192, 4096], [8192, (1 << 30) + 12288, 1808]]


def test_unaligned_descriptor_is_refused():
    m = SpanMap([(0, 1 << 20, 0)])
    with pytest.raises(TransferError, match="aligned"):
        plan_chunks([Descriptor(8, 0, 64)], m, m)


def test_a_bad_descriptor_plans_nothing():
    m = SpanMap([(0, 1 << 20, 0)])
    with pytest.raises(TransferError):
        plan_chunks([Descriptor(0, 0, 64), Descriptor(0, 1 << 20, 64)], m, m)

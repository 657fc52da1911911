"""D's export of its KV memory and P's opening of it (pdkv.transport.ipc_share) for vLLM 0.34's extensible KV cache,
whose segments grow by further CUDA VMM allocations mapped after the first: every allocation a region covers is
exported, the descriptors cross a real abstract Unix socket (fd_share), and P maps allocations that lie back to
back in D back to back. No GPU exists here: `FakeGpu` (a named fake) stands for the CUDA driver, its allocations
memfds; everything else is the real code."""

from __future__ import annotations

import os

import pytest

from pdkv.errors import TransferError
from pdkv.wire import IpcAllocation, IpcRegion
from pdkv.transport.cuda_vmm import MappedRun
from pdkv.transport.ipc_share import KvExporter, close_opened, contiguous_runs, open_export

MIB = 1 << 20


class FakeGpu:
    """Stands for the CUDA driver and its VMM calls (no GPU here): `chunks` maps each allocation's base to its size,
    `legacy` the bases of cudaMalloc'd ones; an exported allocation is a memfd holding its base."""

    def __init__(self, chunks: dict[int, int], legacy: frozenset[int] = frozenset()) -> None:
        self.chunks, self.legacy = chunks, legacy
        self.mapped: list[list[tuple[int, int]]] = []  # P: each map_run's (base read from the fd, size)
        self.released: list[int] = []
        self.unmapped: list[int] = []
        self._next = 0x7000_0000_0000

    def vmm(self) -> FakeGpu:
        return self

    def address_range(self, ptr: int) -> tuple[int, int]:
        for base, size in self.chunks.items():
            if base <= ptr < base + size:
                return base, size
        raise TransferError(f"0x{ptr:x} is not mapped")

    def handle_of(self, base: int) -> int | None:
        return None if base in self.legacy else base

    def exportable(self, handle: int) -> bool:
        return True

    def export_fd(self, handle: int) -> int:
        fd = os.memfd_create("pdkv-fake-vmm")
        os.write(fd, handle.to_bytes(8, "little"))
        return fd

    def release(self, handle: int) -> None:
        self.released.append(handle)

    def ipc_handle(self, base: int) -> bytes:
        return base.to_bytes(64, "little")

    def ipc_open(self, handle: bytes) -> int:
        return int.from_bytes(handle, "little") + 0x1000_0000_0000

    def ipc_close(self, ptr: int) -> None:
        self.unmapped.append(ptr)

    def import_fd(self, fd: int) -> int:
        return int.from_bytes(os.pread(fd, 8, 0), "little")

    def map_run(self, parts: list[tuple[int, int]], devices: list[int]):
        self.mapped.append(parts)
        run = MappedRun(self._next, [size for _, size in parts])
        self._next += run.size + 64 * MIB
        return run

    def unmap(self, run) -> None:
        self.unmapped.append(run.ptr)


def test_contiguous_runs_group_allocations_back_to_back_in_the_exporter():
    allocs = [IpcAllocation(b"", 0x40_0000, 2 * MIB, fd=True), IpcAllocation(b"", 0x20_0000, 2 * MIB, fd=True),
              IpcAllocation(b"h" * 64, 0x60_0000, 2 * MIB), IpcAllocation(b"", 0x100_0000, 2 * MIB, fd=True),
              IpcAllocation(b"", 0x60_0000, 4 * MIB, fd=True)]
    assert contiguous_runs(allocs) == [[1, 0, 4], [3]]
    assert contiguous_runs([]) == []


def test_a_region_over_three_allocations_opens_contiguous_in_p():
    base = 0x10_0000_0000
    d = FakeGpu({base: 2 * MIB, base + 2 * MIB: 2 * MIB, base + 4 * MIB: 2 * MIB, base + 64 * MIB: 2 * MIB})
    exporter = KvExporter(d, 0, "GPU-fake")  # type: ignore[arg-type]
    try:
        export = exporter.make([(base + MIB, 5 * MIB - 4096), (base + 64 * MIB, MIB)])
        assert [(a.base - base, a.size, a.fd) for a in export.allocations] == [
            (0, 2 * MIB, True), (2 * MIB, 2 * MIB, True), (4 * MIB, 2 * MIB, True), (64 * MIB, 2 * MIB, True)]
        assert [r.alloc for r in export.regions] == [0, 3]
        assert d.released == [a.base for a in export.allocations]  # D's retained handles go back at once

        p = FakeGpu({})
        opened = open_export(p, export, 0)  # type: ignore[arg-type]
        # The three back-to-back allocations were mapped as one range, in D's order; the fourth alone.
        assert [[(h - base, s) for h, s in run] for run in p.mapped] == [
            [(0, 2 * MIB), (2 * MIB, 2 * MIB), (4 * MIB, 2 * MIB)], [(64 * MIB, 2 * MIB)]]
        assert sorted(p.released) == [a.base for a in export.allocations]  # imported handles: the mappings hold them
        first = opened.runs[0].ptr
        assert opened.pointers[:3] == [first, first + 2 * MIB, first + 4 * MIB]
        start, end, here = opened.span(export, export.regions[0])
        assert (start, end, here) == (base + MIB, base + 6 * MIB - 4096, first + MIB)
        # A region claiming more than its run is refused, as is one naming an allocation that is not there.
        with pytest.raises(TransferError, match="outside the allocations"):
            opened.span(export, IpcRegion(0, base + MIB, 6 * MIB))
        with pytest.raises(TransferError, match="outside the allocations"):
            opened.span(export, IpcRegion(3, base + 63 * MIB, 2 * MIB))
        with pytest.raises(TransferError, match="names allocation 9"):
            opened.span(export, IpcRegion(9, base, MIB))
        runs = [run.ptr for run in opened.runs]
        close_opened(p, opened)  # type: ignore[arg-type]
        assert sorted(p.unmapped) == sorted(runs) and len(runs) == 2
    finally:
        exporter.drop()


def test_legacy_and_descriptor_allocations_mix():
    base = 0x20_0000_0000
    d = FakeGpu({base: 8 * MIB, base + 8 * MIB: 2 * MIB}, legacy=frozenset({base}))
    exporter = KvExporter(d, 0, "GPU-fake")  # type: ignore[arg-type]
    try:
        export = exporter.make([(base, 4 * MIB), (base + 8 * MIB, MIB)])
        assert [a.fd for a in export.allocations] == [False, True] and export.fd_server
        p = FakeGpu({})
        opened = open_export(p, export, 0)  # type: ignore[arg-type]
        assert opened.pointers[0] == base + 0x1000_0000_0000 and opened.reach[0] == base + 8 * MIB
        assert opened.span(export, export.regions[1])[2] == opened.runs[0].ptr
        close_opened(p, opened)  # type: ignore[arg-type]
        assert set(p.unmapped) == {opened.pointers[0], opened.pointers[1]}
    finally:
        exporter.drop()


def test_an_address_the_driver_places_in_no_allocation_is_refused():
    class Misplacing(FakeGpu):
        def address_range(self, ptr: int) -> tuple[int, int]:
            return ptr + MIB, MIB

    exporter = KvExporter(Misplacing({}), 0, "GPU-fake")  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="in no allocation"):
        exporter.make([(0x30_0000_0000, MIB)])

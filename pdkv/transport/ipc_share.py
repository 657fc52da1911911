"""How D's KV memory is shared with P on one GPU host: D's export (what the ipc transport's `hello()` sends) and
P's opening of it, for both kinds of allocation a vLLM may hand the connector:
- memory from cudaMalloc (torch's allocator; vLLM before 0.34, or 0.34 without its extensible KV cache): a
  legacy CUDA IPC handle per allocation, opened with cuIpcOpenMemHandle;
- a CUDA VMM allocation (vLLM 0.34's extensible KV cache, created exportable because the connector declares
  EXPORTS_FD): a POSIX file descriptor per allocation, which P fetches from D's descriptor server (fd_share,
  with the export's token), imports and maps (cuda_vmm). A region may span several such allocations (a segment
  grown after warm-up); P maps allocations that lie back to back in D back to back too (`contiguous_runs`).
"""

from __future__ import annotations

import os

from pdkv.errors import TransferError
from pdkv.wire import IpcAllocation, IpcExport, IpcRegion
from pdkv.transport.cuda_kernels import CudaDriver
from pdkv.transport.cuda_vmm import MappedRun
from pdkv.transport.fd_share import FdServer, fetch_fds
from pdkv.transport.host import host_id, process_start_time

__all__ = ["KvExporter", "OpenedPeer", "close_opened", "contiguous_runs", "open_export"]


class KvExporter:
    """D's side: the export of a registered set of regions, made once and kept (with its descriptor server)
    until `drop()`. Not thread-safe: the transport's lock guards it."""

    def __init__(self, driver: CudaDriver, device: int, device_uuid: str) -> None:
        self.driver, self.vmm = driver, driver.vmm()
        self.device, self.device_uuid = device, device_uuid
        self.export: IpcExport | None = None
        self._server: FdServer | None = None

    def make(self, local: list[tuple[int, int]]) -> IpcExport:
        if self.export is None:
            self.export = self._make(local)
        return self.export

    def _make(self, local: list[tuple[int, int]]) -> IpcExport:
        allocations: list[IpcAllocation] = []
        index: dict[int, int] = {}
        regions: list[IpcRegion] = []
        fds: list[int] = []
        try:
            for addr, length in local:
                first = None
                for base, size in self._allocations_under(addr, length):
                    if base not in index:
                        index[base] = len(allocations)
                        allocations.append(self._allocation(base, size, fds))
                    first = index[base] if first is None else first
                if first is None:
                    raise TransferError(f"an empty KV region at 0x{addr:x} cannot be exported")
                regions.append(IpcRegion(first, addr, length))
            server = FdServer(fds) if fds else None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._server = server
        return IpcExport(host_id(), os.getpid(), self.device, self.device_uuid, allocations, regions,
                         process_start_time(os.getpid()), fd_server=server.name if server else "",
                         fd_token=server.token if server else b"")

    def _allocations_under(self, addr: int, length: int) -> list[tuple[int, int]]:
        """(base, size) of each allocation the range covers, in order: one for cudaMalloc'd memory, one or more
        for a segment of vLLM's extensible KV cache."""
        found, cursor, end = [], addr, addr + length
        while cursor < end:
            base, size = self.driver.address_range(cursor)
            if not base <= cursor < base + size:
                raise TransferError(f"the driver placed 0x{cursor:x} in no allocation (0x{base:x}+{size})")
            found.append((base, size))
            cursor = base + size
        return found

    def _allocation(self, base: int, size: int, fds: list[int]) -> IpcAllocation:
        handle = self.vmm.handle_of(base)
        if handle is None:
            return IpcAllocation(self.driver.ipc_handle(base), base, size)
        try:
            if not self.vmm.exportable(handle):
                raise TransferError(
                    "this KV cache is CUDA VMM memory that was not created exportable as a file descriptor",
                    hint="pdkv's connector declares EXPORTS_FD for ipc on vLLM 0.34+; start the engine through `pdkv up`, "
                         "or set ipc_handles = \"legacy\" to turn the extensible KV cache off")
            fds.append(self.vmm.export_fd(handle))
        finally:
            self.vmm.release(handle)
        return IpcAllocation(b"", base, size, fd=True)

    def drop(self) -> None:
        """Forget the export (the registered set changed, or the transport closes): its descriptors close; what
        P already mapped stays valid until P unmaps it."""
        self.export = None
        if self._server is not None:
            self._server.close()
            for fd in self._server.fds:
                os.close(fd)
            self._server = None


class OpenedPeer:
    """P's side: one export opened in this process. `pointers[i]` is allocation i's address here, and `reach[i]` the
    exporter's address where the memory contiguous here from allocation i ends (its own end for a legacy handle,
    its run's for a mapped descriptor)."""

    def __init__(self) -> None:
        self.pointers: list[int] = []
        self.reach: list[int] = []
        self.runs: list[MappedRun] = []  # what `close_opened` unmaps
        self.handles: list[int] = []  # legacy IPC pointers `close_opened` closes

    def span(self, export: IpcExport, region: IpcRegion) -> tuple[int, int, int]:
        """(start, end, address here) of `region`; TransferError if it reaches past what was opened contiguously."""
        if region.alloc >= len(self.pointers):
            raise TransferError(f"region names allocation {region.alloc} of {len(self.pointers)}")
        alloc = export.allocations[region.alloc]
        if region.base < alloc.base or region.base + region.length > self.reach[region.alloc]:
            raise TransferError(f"region 0x{region.base:x}+{region.length} lies outside the allocations exported with it")
        return region.base, region.base + region.length, self.pointers[region.alloc] + region.base - alloc.base


def contiguous_runs(allocations: list[IpcAllocation]) -> list[list[int]]:
    """The indices of the descriptor-shared allocations grouped into runs that lie back to back in the exporter's
    address space, each run in address order (pure: what `open_export` maps as one range)."""
    shared = sorted((a.base, i) for i, a in enumerate(allocations) if a.fd)
    runs: list[list[int]] = []
    end = None
    for base, i in shared:
        if runs and base == end:
            runs[-1].append(i)
        else:
            runs.append([i])
        end = base + allocations[i].size
    return runs


def open_export(driver: CudaDriver, export: IpcExport, device: int) -> OpenedPeer:
    """Open every allocation of `export` (handles, or descriptors fetched from D) for `device`; on any failure
    close what was opened and raise TransferError."""
    vmm = driver.vmm()
    allocations = export.allocations
    opened = OpenedPeer()
    opened.pointers, opened.reach = [0] * len(allocations), [0] * len(allocations)
    handles: dict[int, int] = {}
    try:
        fds = fetch_fds(export.fd_server, export.fd_token, sum(a.fd for a in allocations)) if export.fd_server else []
        try:
            shared = iter(fds)
            for i, alloc in enumerate(allocations):
                if alloc.fd:
                    handles[i] = vmm.import_fd(next(shared))
                else:
                    opened.pointers[i] = driver.ipc_open(alloc.handle)
                    opened.handles.append(opened.pointers[i])
                    opened.reach[i] = alloc.base + alloc.size
            for run in contiguous_runs(allocations):
                mapped = vmm.map_run([(handles[i], allocations[i].size) for i in run], [device])
                opened.runs.append(mapped)
                start, last = allocations[run[0]], allocations[run[-1]]
                for i in run:
                    opened.pointers[i] = mapped.ptr + allocations[i].base - start.base
                    opened.reach[i] = last.base + last.size
        finally:
            for fd in fds:
                os.close(fd)
            for handle in handles.values():  # the mappings hold the memory now
                vmm.release(handle)
    except TransferError:
        close_opened(driver, opened)
        raise
    return opened


def close_opened(driver: CudaDriver, opened: OpenedPeer) -> None:
    """Unmap what `open_export` mapped and close the handles it opened."""
    vmm = driver.vmm()
    for run in opened.runs:
        vmm.unmap(run)
    for ptr in opened.handles:
        driver.ipc_close(ptr)
    opened.runs, opened.handles = [], []

"""How D's KV memory is shared with P on one GPU host: D's export (what the ipc transport's `hello()` sends) and
P's opening of it, for both kinds of allocation a vLLM may hand the connector:
- memory from cudaMalloc (torch's allocator; vLLM before 0.34, or 0.34 without its extensible KV cache): a
  legacy CUDA IPC handle per allocation, opened with cuIpcOpenMemHandle;
- a CUDA VMM allocation (vLLM 0.34's extensible KV cache, created exportable because the connector declares
  EXPORTS_FD): a POSIX file descriptor per allocation, which P fetches from D's descriptor server (fd_share,
  with the export's token), imports and maps (cuda_vmm).
"""

from __future__ import annotations

import os

from pdkv.errors import TransferError
from pdkv.protocol import IpcAllocation, IpcExport, IpcRegion
from pdkv.transport.cuda_kernels import CudaDriver
from pdkv.transport.cuda_vmm import ImportedAllocation
from pdkv.transport.fd_share import FdServer, fetch_fds
from pdkv.transport.host import host_id, process_start_time

__all__ = ["KvExporter", "OpenedPeer", "close_opened", "open_export"]


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
                base, size = self.driver.address_range(addr)
                if base not in index:
                    index[base] = len(allocations)
                    allocations.append(self._allocation(base, size, fds))
                regions.append(IpcRegion(index[base], addr, length))
            server = FdServer(fds) if fds else None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._server = server
        return IpcExport(host_id(), os.getpid(), self.device, self.device_uuid, allocations, regions,
                         process_start_time(os.getpid()), fd_server=server.name if server else "",
                         fd_token=server.token if server else b"")

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
    """P's side: one export opened in this process. `pointers[i]` is allocation i's address here."""

    def __init__(self, pointers: list[int], imported: dict[int, ImportedAllocation]) -> None:
        self.pointers, self.imported = pointers, imported


def open_export(driver: CudaDriver, export: IpcExport, device: int) -> OpenedPeer:
    """Open every allocation of `export` (handles, or descriptors fetched from D) for `device`; on any failure
    close what was opened and raise TransferError."""
    vmm = driver.vmm()
    opened = OpenedPeer([], {})
    try:
        fds = fetch_fds(export.fd_server, export.fd_token, sum(a.fd for a in export.allocations)) if export.fd_server else []
        try:
            shared = iter(fds)
            for alloc in export.allocations:
                if alloc.fd:
                    mapping = vmm.import_fd(next(shared), alloc.size, [device])
                    opened.imported[mapping.ptr] = mapping
                    opened.pointers.append(mapping.ptr)
                else:
                    opened.pointers.append(driver.ipc_open(alloc.handle))
        finally:
            for fd in fds:
                os.close(fd)
    except TransferError:
        close_opened(driver, opened)
        raise
    return opened


def close_opened(driver: CudaDriver, opened: OpenedPeer) -> None:
    """Unmap what `open_export` mapped and close the handles it opened."""
    vmm = driver.vmm()
    for ptr in opened.pointers:
        if ptr in opened.imported:
            vmm.unmap(opened.imported[ptr])
        else:
            driver.ipc_close(ptr)

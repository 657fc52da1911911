"""CUDA virtual memory (VMM) allocations shared between processes as POSIX file descriptors.

vLLM 0.34's extensible KV cache reserves address space and maps physical allocations into it (cuMemCreate,
cuMemMap); legacy CUDA IPC (cuIpcGetMemHandle) cannot export such memory. When the connector declares
`EXPORTS_FD`, vLLM creates every allocation exportable as a file descriptor. A segment (one layer's blocks) grows
by further allocations mapped after the first (warm-up commits a few blocks, the final size the rest), so one
region may span several. D exports each allocation here, the descriptors cross to P (fd_share), and P maps those
that lie back to back in D back to back in its own address space (`map_run`): a region contiguous in D is
contiguous in P.

The driver calls go through ctypes, as cuda_kernels.CudaDriver's do; the structures follow cuda.h.
"""

from __future__ import annotations

import ctypes
from typing import Any

from pdkv.errors import TransferError

__all__ = ["MappedRun", "VmmDriver"]

_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_LOCATION_TYPE_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_ERROR_INVALID_VALUE = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class MappedRun:
    """Allocations mapped back to back at `ptr` in this process (`parts`: each one's size, in order);
    `VmmDriver.unmap` undoes it."""

    def __init__(self, ptr: int, parts: list[int]) -> None:
        self.ptr, self.parts = ptr, parts

    @property
    def size(self) -> int:
        return sum(self.parts)


class VmmDriver:
    """The VMM calls the ipc transport needs, over the CUDA driver library `lib` (a ctypes CDLL) and its checker."""

    def __init__(self, lib: Any, check: Any) -> None:
        self.lib, self._check = lib, check

    def handle_of(self, base: int) -> int | None:
        """The VMM allocation mapped at `base` (retained: `release` it), or None for memory CUDA IPC exports
        (cudaMalloc's), which the driver answers with CUDA_ERROR_INVALID_VALUE."""
        handle = ctypes.c_ulonglong()
        rc = self.lib.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(base))
        if rc == _ERROR_INVALID_VALUE:
            return None
        self._check(rc, "cuMemRetainAllocationHandle")
        return handle.value

    def exportable(self, handle: int) -> bool:
        """Whether the allocation was created exportable as a POSIX file descriptor (vLLM does so under EXPORTS_FD)."""
        return bool(self._properties(handle).requestedHandleTypes & _HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)

    def export_fd(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self._check(self.lib.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_ulonglong(handle),
                                                          ctypes.c_int(_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), ctypes.c_ulonglong(0)),
                    "cuMemExportToShareableHandle")
        return fd.value

    def import_fd(self, fd: int) -> int:
        """The allocation behind `fd` (the caller still closes it) as a handle of this process: `release` it once mapped."""
        handle = ctypes.c_ulonglong()
        self._check(self.lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                            ctypes.c_int(_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)),
                    "cuMemImportFromShareableHandle")
        return handle.value

    def release(self, handle: int) -> None:
        self._check(self.lib.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")

    def _properties(self, handle: int) -> _AllocationProp:
        prop = _AllocationProp()
        self._check(self.lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), ctypes.c_ulonglong(handle)),
                    "cuMemGetAllocationPropertiesFromHandle")
        return prop

    def map_run(self, parts: list[tuple[int, int]], devices: list[int]) -> MappedRun:
        """Map the allocations `parts` ((handle, size) each) back to back in one new address range, and give
        `devices` and the GPUs that hold them read/write access: memory contiguous in its owner stays contiguous
        here. The handles stay the caller's (mapped memory lives until unmapped, released or not). TransferError
        if the driver refuses any step (nothing is left mapped)."""
        total = sum(size for _, size in parts)
        ptr = ctypes.c_ulonglong()
        devices = sorted({*devices, *(self._properties(handle).location.id for handle, _ in parts)})
        self._check(self.lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(total), ctypes.c_size_t(0),
                                                 ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        run = MappedRun(ptr.value, [])
        try:
            for handle, size in parts:
                self._check(self.lib.cuMemMap(ctypes.c_ulonglong(run.ptr + run.size), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                              ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0)), "cuMemMap")
                run.parts.append(size)
            access = (_AccessDesc * len(devices))(*[_AccessDesc(_Location(_LOCATION_TYPE_DEVICE, d), _ACCESS_READWRITE) for d in devices])
            self._check(self.lib.cuMemSetAccess(ctypes.c_ulonglong(run.ptr), ctypes.c_size_t(total), access,
                                                ctypes.c_size_t(len(devices))), "cuMemSetAccess")
        except TransferError:
            self._unmap_parts(run)
            self.lib.cuMemAddressFree(ctypes.c_ulonglong(run.ptr), ctypes.c_size_t(total))  # the range reserved whole
            raise
        return run

    def allocate(self, size: int, device: int, chunks: int = 1) -> MappedRun:
        """At least `size` bytes on `device` in `chunks` allocations mapped back to back, each exportable as a file
        descriptor, as vLLM 0.34's extensible KV cache backs a segment under EXPORTS_FD once it has grown (the GPU
        tests' D uses it); `unmap` frees it."""
        prop = _AllocationProp(type=1, requestedHandleTypes=_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                               location=_Location(_LOCATION_TYPE_DEVICE, device))  # type 1: CU_MEM_ALLOCATION_TYPE_PINNED
        granule = ctypes.c_size_t()
        self._check(self.lib.cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(prop), ctypes.c_int(0)),
                    "cuMemGetAllocationGranularity")
        part = -(-size // (chunks * granule.value)) * granule.value
        handles: list[int] = []
        try:
            for _ in range(chunks):
                handle = ctypes.c_ulonglong()
                self._check(self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(part), ctypes.byref(prop),
                                                 ctypes.c_ulonglong(0)), "cuMemCreate")
                handles.append(handle.value)
            return self.map_run([(h, part) for h in handles], [device])
        finally:
            for handle in handles:
                self.release(handle)

    def unmap(self, run: MappedRun) -> None:
        for rc in self._unmap_parts(run):
            self._check(rc, "cuMemUnmap")
        self._check(self.lib.cuMemAddressFree(ctypes.c_ulonglong(run.ptr), ctypes.c_size_t(run.size)), "cuMemAddressFree")

    def _unmap_parts(self, run: MappedRun) -> list[int]:
        """Unmap each part where it was mapped (a mapping is undone whole, never a range across several); the codes."""
        codes, offset = [], 0
        for size in run.parts:
            codes.append(self.lib.cuMemUnmap(ctypes.c_ulonglong(run.ptr + offset), ctypes.c_size_t(size)))
            offset += size
        return codes

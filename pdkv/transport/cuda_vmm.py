"""CUDA virtual memory (VMM) allocations shared between processes as POSIX file descriptors.

vLLM 0.34's extensible KV cache reserves address space and maps physical allocations into it (cuMemCreate,
cuMemMap); legacy CUDA IPC (cuIpcGetMemHandle) cannot export such memory. When the connector declares
`EXPORTS_FD`, vLLM creates each segment as one allocation exportable as a file descriptor; D exports it here,
the descriptor crosses to P (fd_share), and P imports and maps it into its own address space.

The driver calls go through ctypes, as cuda_kernels.CudaDriver's do; the structures follow cuda.h.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from pdkv.errors import TransferError

__all__ = ["ImportedAllocation", "VmmDriver"]

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


class ImportedAllocation:
    """A peer's allocation mapped at `ptr` in this process; `VmmDriver.unmap` undoes it."""

    def __init__(self, ptr: int, size: int, handle: int) -> None:
        self.ptr, self.size, self.handle = ptr, size, handle


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

    def release(self, handle: int) -> None:
        self._check(self.lib.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")

    def _properties(self, handle: int) -> _AllocationProp:
        prop = _AllocationProp()
        self._check(self.lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), ctypes.c_ulonglong(handle)),
                    "cuMemGetAllocationPropertiesFromHandle")
        return prop

    def import_fd(self, fd: int, size: int, devices: list[int]) -> ImportedAllocation:
        """Import the allocation behind `fd` (the caller still closes it), map its first `size` bytes and give
        `devices` and the GPU that holds it read/write access. TransferError if the driver refuses any step
        (nothing is left mapped)."""
        handle = ctypes.c_ulonglong()
        self._check(self.lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                            ctypes.c_int(_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)),
                    "cuMemImportFromShareableHandle")
        ptr = ctypes.c_ulonglong()
        reserved = mapped = False
        try:
            devices = sorted({*devices, self._properties(handle.value).location.id})
            self._check(self.lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                                     ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
            reserved = True
            self._check(self.lib.cuMemMap(ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                          ctypes.c_ulonglong(handle.value), ctypes.c_ulonglong(0)), "cuMemMap")
            mapped = True
            access = (_AccessDesc * len(devices))(*[_AccessDesc(_Location(_LOCATION_TYPE_DEVICE, d), _ACCESS_READWRITE) for d in devices])
            self._check(self.lib.cuMemSetAccess(ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(size), access,
                                                ctypes.c_size_t(len(devices))), "cuMemSetAccess")
        except TransferError:
            if mapped:
                self.lib.cuMemUnmap(ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(size))
            if reserved:
                self.lib.cuMemAddressFree(ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(size))
            self.lib.cuMemRelease(handle)
            raise
        return ImportedAllocation(ptr.value, size, handle.value)

    def allocate(self, size: int, device: int) -> ImportedAllocation:
        """A new allocation of at least `size` bytes on `device`, exportable as a file descriptor and mapped here, as
        vLLM 0.34 makes each KV segment under EXPORTS_FD (the GPU tests' D uses it); `unmap` frees it."""
        prop = _AllocationProp(type=1, requestedHandleTypes=_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                               location=_Location(_LOCATION_TYPE_DEVICE, device))  # type 1: CU_MEM_ALLOCATION_TYPE_PINNED
        granule = ctypes.c_size_t()
        self._check(self.lib.cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(prop), ctypes.c_int(0)),
                    "cuMemGetAllocationGranularity")
        size = -(-size // granule.value) * granule.value
        handle = ctypes.c_ulonglong()
        self._check(self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)),
                    "cuMemCreate")
        fd = self.export_fd(handle.value)
        try:
            return self.import_fd(fd, size, [device])
        finally:
            os.close(fd)
            self.release(handle.value)

    def unmap(self, imported: ImportedAllocation) -> None:
        ptr, size = ctypes.c_ulonglong(imported.ptr), ctypes.c_size_t(imported.size)
        self._check(self.lib.cuMemUnmap(ptr, size), "cuMemUnmap")
        self._check(self.lib.cuMemAddressFree(ptr, size), "cuMemAddressFree")
        self.release(imported.handle)

"""The CUDA pieces under the ipc transport: a few driver calls through ctypes, the Triton copy kernels, and
whether two GPUs can take that path (ipc_reachable).

Nothing here is imported until a CudaIpcTransport starts; torch and Triton
are imported inside the functions that need them.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from pdkv.errors import StartError, TransferError
from pdkv.transport.cuda_vmm import VmmDriver

IPC_HANDLE_BYTES = 64


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


# CUresult codes and attributes used below.
_PEER_ACCESS_ALREADY_ENABLED = 704
_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


class CudaDriver:
    """The few CUDA driver calls IPC needs, through ctypes (no extra Python package)."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise StartError("CUDA driver (libcuda.so.1) not found", hint="the ipc transport needs NVIDIA GPUs") from exc

    def check(self, rc: int, what: str) -> None:
        """TransferError naming `what` and the driver's error when `rc` is not CUDA_SUCCESS."""
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise TransferError(f"{what} failed: {name.value.decode() if name.value else rc}")

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)), "cuMemGetAddressRange")
        return base.value, size.value

    def ipc_handle(self, base: int) -> bytes:
        handle = IpcMemHandle()
        self.check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base)), "cuIpcGetMemHandle")
        return bytes(handle)

    def ipc_open(self, handle: bytes) -> int:
        ptr = ctypes.c_uint64()
        # The handle is a 64-byte struct passed by value; 1 = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
        raw = IpcMemHandle.from_buffer_copy(handle)
        self.check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, ctypes.c_uint(1)), "cuIpcOpenMemHandle")
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self.check(self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")

    def host_device_pointer(self, ptr: int) -> int:
        """The address at which kernels reach pinned host memory at `ptr` (page-locked by CUDA, as torch's pin_memory
        is): with unified addressing usually `ptr` itself."""
        dptr = ctypes.c_uint64()
        self.check(self.lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(ptr), ctypes.c_uint(0)),
                    "cuMemHostGetDevicePointer")
        return dptr.value

    def async_copy(self) -> Any:
        """cuMemcpyAsync(dst, src, bytes, stream) -> CUresult, called without releasing the interpreter's lock (the
        call only queues the copy on the stream, a few microseconds): a thread queueing thousands of copies does not
        hand the lock to the process's other threads and back for each. Check a non-zero result with `check`."""
        fn = ctypes.PyDLL("libcuda.so.1").cuMemcpyAsync
        fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn

    def vmm(self) -> VmmDriver:
        """The virtual-memory calls (CUDA VMM allocations shared as file descriptors) over this driver."""
        return VmmDriver(self.lib, self.check)

    def device_of(self, ptr: int) -> int:
        ordinal = ctypes.c_int()
        self.check(
            self.lib.cuPointerGetAttribute(ctypes.byref(ordinal), ctypes.c_int(_POINTER_ATTRIBUTE_DEVICE_ORDINAL), ctypes.c_uint64(ptr)),
            "cuPointerGetAttribute",
        )
        return ordinal.value

    def enable_peer_access(self, from_device: int, to_device: int) -> None:
        """Let kernels on `from_device` read `to_device`'s memory (primary contexts, as torch uses)."""
        ctx_from, ctx_to, prev = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx_from), ctypes.c_int(from_device)), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx_to), ctypes.c_int(to_device)), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(prev)), "cuCtxGetCurrent")
        try:
            self.check(self.lib.cuCtxSetCurrent(ctx_from), "cuCtxSetCurrent")
            rc = self.lib.cuCtxEnablePeerAccess(ctx_to, ctypes.c_uint(0))
            if rc != _PEER_ACCESS_ALREADY_ENABLED:
                self.check(rc, f"enabling peer access from GPU {from_device} to GPU {to_device}")
        finally:
            self.lib.cuCtxSetCurrent(prev)


KERNELS: dict[str, Any] = {}
# Triton compiles a kernel, builds its launcher and loads both at the kernel's first launch in a process, with no lock
# of its own: threads doing that at once can fail or crash the process (triton-lang/triton#5933). A launch that may be
# a kernel's first from one of several threads, and a graph capture holding one, runs under this lock.
FIRST_LAUNCH = threading.RLock()


def copy_kernels() -> dict[str, Any]:
    """Two Triton kernels: copy listed chunks, and copy whole blocks addressed on the GPU.

    Addresses arrive as int64 and become pointers in the kernel; the hints
    say they are 16-byte aligned (checked on the host) so loads and stores vectorize.
    """
    with FIRST_LAUNCH:
        return _define_kernels()


def _define_kernels() -> dict[str, Any]:
    if not KERNELS:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_chunks(tab, stride, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            src = tl.multiple_of(tl.load(tab + pid * stride), 16).to(tl.pointer_type(tl.int64))
            dst = tl.multiple_of(tl.load(tab + pid * stride + 1), 16).to(tl.pointer_type(tl.int64))
            n = tl.load(tab + pid * stride + 2)
            for start in tl.range(0, CHUNK_WORDS, BLOCK, num_stages=3):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

        @triton.jit(do_not_specialize=["n_blocks", "chunks"])
        def copy_blocks(lbase, rbase, lblk, rblk, n_blocks, chunks, block_bytes, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            c = pid % chunks
            rest = pid // chunks
            i = rest % n_blocks
            r = rest // n_blocks
            skip = c * CHUNK_WORDS * 8
            s = tl.load(lbase + r) + tl.load(lblk + i) * block_bytes + skip
            d = tl.load(rbase + r) + tl.load(rblk + i) * block_bytes + skip
            src = tl.multiple_of(s, 16).to(tl.pointer_type(tl.int64))
            dst = tl.multiple_of(d, 16).to(tl.pointer_type(tl.int64))
            n = block_bytes // 8 - c * CHUNK_WORDS
            for start in tl.range(0, CHUNK_WORDS, BLOCK, num_stages=3):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

        KERNELS["chunks"] = copy_chunks
        KERNELS["blocks"] = copy_blocks
    return KERNELS


def ipc_reachable(src_device: int, dst_device: int) -> tuple[bool, str]:
    """Whether P's GPU can write D's GPU directly; the reason when not (for the logged fallback)."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible"
    n = torch.cuda.device_count()
    if max(src_device, dst_device) >= n:
        return False, f"only {n} CUDA devices visible"
    if src_device != dst_device and not torch.cuda.can_device_access_peer(src_device, dst_device):
        return False, f"GPU {src_device} cannot access GPU {dst_device} as a peer (no NVLink/P2P path)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "Triton is not installed"
    return True, "peer access available"

"""Intra-node GPU transport: D's KV memory opened in P through CUDA IPC, written by one copy kernel.

D exports a CUDA IPC handle for each allocation that holds a registered KV
region (once per layout); P opens each handle once and writes a request's
blocks with a single kernel launch that streams every descriptor over
NVLink/P2P, so 2,268 per-block descriptors cost about what 36 coalesced ones
do. Every descriptor is checked against the registered local regions and the
exported remote regions before anything is copied; nothing outside D's
exported KV regions is ever written.

Needs torch with CUDA and Triton (both come with vLLM on GPU hosts). The
handle protocol and descriptor translation are pure and run anywhere.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from pdkv.errors import StartError, TransferError
from pdkv.transport.base import Descriptor

log = logging.getLogger(__name__)

# Each kernel program copies one chunk; long descriptors are split so the
# grid keeps every SM busy whether the layout has 36 or 2,268 descriptors.
CHUNK_BYTES = 64 * 1024
IPC_HANDLE_BYTES = 64


class IpcRegion(msgspec.Struct, frozen=True, array_like=True):
    """One exported KV region: `length` bytes at `base` (exporter's address), inside allocation `alloc`."""

    alloc: int  # index into IpcExport.allocations
    base: int
    length: int


class IpcAllocation(msgspec.Struct, frozen=True, array_like=True):
    handle: bytes  # cudaIpcMemHandle_t of the allocation
    base: int  # allocation base in the exporter's address space
    size: int


class IpcExport(msgspec.Struct, frozen=True):
    """What D sends P once per layout so P can open D's KV regions."""

    host_id: str  # boot id + hostname: IPC works only inside one host (one kernel)
    pid: int
    device: int
    device_uuid: str
    allocations: list[IpcAllocation]
    regions: list[IpcRegion]


def host_id(proc_root: str = "/") -> str:
    boot = Path(proc_root, "proc/sys/kernel/random/boot_id")
    try:
        boot_id = boot.read_text().strip()
    except OSError:
        boot_id = "unknown"
    return f"{socket.gethostname()}/{boot_id}"


class SpanMap:
    """Sorted, non-overlapping address spans, each mapped to where it lives in this process.

    `translate` maps whole ranges (vectorized) and refuses any range that does
    not lie inside a single span.
    """

    def __init__(self, spans: Sequence[tuple[int, int, int]]) -> None:
        import numpy as np

        ordered = sorted((s, e, m) for s, e, m in spans if e > s)
        for (_, a_end, _), (b_start, _, _) in zip(ordered, ordered[1:], strict=False):
            if b_start < a_end:
                raise TransferError(f"regions overlap at 0x{b_start:x}")
        table = np.array(ordered, dtype=np.int64).reshape(-1, 3)
        self._starts, self._ends, self._mapped = table[:, 0], table[:, 1], table[:, 2]

    def translate_many(self, addr, length, side: str):
        """Map int64 arrays of (addr, length) ranges; raise TransferError naming the first bad one."""
        import numpy as np

        i = np.searchsorted(self._starts, addr, side="right") - 1
        safe = np.clip(i, 0, max(len(self._starts) - 1, 0))
        if len(self._starts) == 0:
            ok = np.zeros(len(addr), dtype=bool)
        else:
            ok = (i >= 0) & (length > 0) & (addr + length <= self._ends[safe])
        if not ok.all():
            bad = int(np.argmin(ok))
            raise TransferError(f"{side} range 0x{int(addr[bad]):x}+{int(length[bad])} is outside the registered KV regions")
        return addr - self._starts[safe] + self._mapped[safe]

    def translate(self, addr: int, length: int, side: str) -> int:
        import numpy as np

        return int(self.translate_many(np.array([addr], dtype=np.int64), np.array([length], dtype=np.int64), side)[0])


def plan_chunks(descriptors: Sequence[Descriptor], local: SpanMap, remote: SpanMap, chunk: int = CHUNK_BYTES):
    """Check, translate and split descriptors into an int64 array of (src, dst, nbytes) rows, each at most `chunk` bytes.

    Raises TransferError before returning anything if one descriptor leaves
    the local or the remote regions, or is not 16-byte aligned.
    """
    import numpy as np

    if not descriptors:
        return np.zeros((0, 3), dtype=np.int64)
    d = np.array(msgspec.to_builtins(descriptors), dtype=np.int64).reshape(-1, 3)
    src, dst, length = d[:, 0], d[:, 1], d[:, 2]
    misaligned = (src | dst | length) % 16 != 0
    if misaligned.any():
        raise TransferError(f"descriptor {descriptors[int(np.argmax(misaligned))]} is not 16-byte aligned")
    s = local.translate_many(src, length, "local")
    t = remote.translate_many(dst, length, "remote")
    counts = -(-length // chunk)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(int(counts.sum()), dtype=np.int64) - first) * chunk
    length_rep = np.repeat(length, counts)
    out = np.empty((len(offset), 3), dtype=np.int64)
    out[:, 0] = np.repeat(s, counts) + offset
    out[:, 1] = np.repeat(t, counts) + offset
    out[:, 2] = np.minimum(chunk, length_rep - offset)
    return out


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _Driver:
    """The few CUDA driver calls IPC needs, through ctypes (no extra Python package)."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise StartError("CUDA driver (libcuda.so.1) not found", hint="the ipc transport needs NVIDIA GPUs") from exc

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise TransferError(f"{what} failed: {name.value.decode() if name.value else rc}")

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)), "cuMemGetAddressRange")
        return base.value, size.value

    def ipc_handle(self, base: int) -> bytes:
        handle = _IpcMemHandle()
        self._check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base)), "cuIpcGetMemHandle")
        return bytes(handle)

    def ipc_open(self, handle: bytes) -> int:
        ptr = ctypes.c_uint64()
        # The handle is a 64-byte struct passed by value.
        raw = _IpcMemHandle.from_buffer_copy(handle)
        # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
        self._check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, ctypes.c_uint(1)), "cuIpcOpenMemHandle")
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self._check(self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")


_KERNEL: Any = None


def _copy_kernel():
    """The Triton kernel: program i copies chunk i from src[i] to dst[i], 16 bytes per lane."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_chunks(src_tab, dst_tab, len_tab, stride, CHUNK_WORDS: tl.constexpr, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            src = tl.load(src_tab + pid * stride).to(tl.pointer_type(tl.int64))
            dst = tl.load(dst_tab + pid * stride).to(tl.pointer_type(tl.int64))
            n = tl.load(len_tab + pid * stride)
            src = tl.multiple_of(src, 16)
            dst = tl.multiple_of(dst, 16)
            for start in tl.range(0, CHUNK_WORDS, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
                mask = offs < n
                tl.store(dst + offs, tl.load(src + offs, mask=mask, cache_modifier=".cg"), mask=mask, cache_modifier=".cs")

        _KERNEL = copy_chunks
    return _KERNEL


class CudaIpcTransport:
    """Transport for P and D on one host: `export()` on D, `connect()` then `write()` on P.

    `device` is this process's CUDA device index. Opened handles are closed by
    `close()` (or leaving the `with` block) and when a peer is reconnected.
    """

    protocol = "ipc"

    def __init__(self, device: int = 0, *, chunk_bytes: int = CHUNK_BYTES, block: int = 1024, num_warps: int = 8) -> None:
        import torch

        if not torch.cuda.is_available():
            raise StartError("no CUDA device visible", hint="the ipc transport needs GPUs; use --protocol tcp or rdma")
        self.torch = torch
        self.device = device
        torch.cuda.set_device(device)
        torch.cuda.init()
        self.driver = _Driver()
        self.chunk_bytes = chunk_bytes
        self.block = block
        self.num_warps = num_warps
        self._table = None
        self._dev_table = None
        self._local: list[tuple[int, int]] = []
        self._local_map = SpanMap([])
        self._peers: dict[str, tuple[SpanMap, list[int]]] = {}
        self._stream = torch.cuda.Stream(device)

    @property
    def session_address(self) -> str:
        return f"ipc://{host_id()}/{os.getpid()}/{self.device}"

    def register(self, regions: list[tuple[int, int]]) -> None:
        self._local.extend(regions)
        self._local_map = SpanMap([(a, a + n, a) for a, n in self._local])

    def unregister(self, regions: list[tuple[int, int]]) -> None:
        gone = set(regions)
        self._local = [r for r in self._local if r not in gone]
        self._local_map = SpanMap([(a, a + n, a) for a, n in self._local])

    def export(self) -> IpcExport:
        """Handles for the allocations behind every registered region (only those regions are writable by P)."""
        allocations: list[IpcAllocation] = []
        index: dict[int, int] = {}
        regions: list[IpcRegion] = []
        for addr, length in self._local:
            base, size = self.driver.address_range(addr)
            if base not in index:
                index[base] = len(allocations)
                allocations.append(IpcAllocation(self.driver.ipc_handle(base), base, size))
            regions.append(IpcRegion(index[base], addr, length))
        props = self.torch.cuda.get_device_properties(self.device)
        return IpcExport(host_id(), os.getpid(), self.device, str(getattr(props, "uuid", "")), allocations, regions)

    def connect(self, peer: str, export: IpcExport) -> None:
        """Open `export`'s handles once; `peer` is the name later writes use."""
        if export.host_id != host_id():
            raise TransferError(f"peer {peer} is on another host ({export.host_id}); CUDA IPC works within one host")
        if export.pid == os.getpid():
            raise TransferError("CUDA IPC cannot open handles exported by the same process")
        self.disconnect(peer)
        opened: list[int] = []
        try:
            for alloc in export.allocations:
                opened.append(self.driver.ipc_open(alloc.handle))
        except TransferError:
            for ptr in opened:
                self.driver.ipc_close(ptr)
            raise
        spans = []
        for region in export.regions:
            alloc = export.allocations[region.alloc]
            if region.base < alloc.base or region.base + region.length > alloc.base + alloc.size:
                raise TransferError(f"peer {peer} exported a region outside its allocation")
            spans.append((region.base, region.base + region.length, opened[region.alloc] + region.base - alloc.base))
        self._peers[peer] = (SpanMap(spans), opened)
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile and load the copy kernel now, so a request's first transfer does not pay for it."""
        import numpy as np

        scratch = self.torch.zeros(64, dtype=self.torch.uint8, device=f"cuda:{self.device}")
        base = scratch.data_ptr()
        self._launch(np.array([[base, base + 32, 32]], dtype=np.int64))
        self._stream.synchronize()

    def disconnect(self, peer: str) -> None:
        entry = self._peers.pop(peer, None)
        if entry is not None:
            self.torch.cuda.synchronize(self.device)
            for ptr in entry[1]:
                self.driver.ipc_close(ptr)

    def write(self, peer: str, descriptors: list[Descriptor]) -> None:
        if peer not in self._peers:
            raise TransferError(f"no CUDA IPC session with {peer}", hint="the peer's export must be connected first")
        chunks = plan_chunks(descriptors, self._local_map, self._peers[peer][0], self.chunk_bytes)
        if len(chunks):
            self._launch(chunks)
        self._stream.synchronize()

    def _launch(self, chunks) -> None:
        torch = self.torch
        n = len(chunks)
        if self._table is None or self._table.shape[0] < n:
            self._table = torch.empty((max(n, 4096), 3), dtype=torch.int64).pin_memory()
            self._dev_table = torch.empty((max(n, 4096), 3), dtype=torch.int64, device=f"cuda:{self.device}")
        host = self._table[:n]
        host.numpy()[:] = chunks
        host[:, 2] //= 8
        with torch.cuda.stream(self._stream):
            dev = self._dev_table[:n]
            dev.copy_(host, non_blocking=True)
            cols = dev.t()
            _copy_kernel()[(n,)](
                cols[0], cols[1], cols[2], 3, CHUNK_WORDS=self.chunk_bytes // 8, BLOCK=self.block, num_warps=self.num_warps
            )

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)

    def __enter__(self) -> CudaIpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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

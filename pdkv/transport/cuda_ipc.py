"""Intra-node GPU transport: D's KV memory opened in P through CUDA IPC, written by one copy kernel.

D exports a CUDA IPC handle for each allocation that holds a registered KV
region (once per layout), or, for CUDA VMM allocations (vLLM 0.34's extensible
KV cache), a file descriptor that P fetches from D over a Unix socket
(fd_share) and maps; P opens each handle once and writes a request's
blocks with a single kernel launch that streams every descriptor over
NVLink/P2P, so 2,268 per-block descriptors cost about what 36 coalesced ones
do. Every descriptor is checked against the registered local regions and the
exported remote regions before anything is copied; nothing outside D's
exported KV regions is ever written, nor a dead D's (host.WatchedPeers: checked before and after each copy).

Needs torch with CUDA and Triton (both come with vLLM on GPU hosts). The
handle protocol and descriptor translation are pure and run anywhere.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from pdkv.errors import StartError, TransferError
from pdkv.wire import IpcAllocation, IpcExport, IpcRegion
from pdkv.transport.base import Descriptor, Region, UncheckedWrites, Written
from pdkv.transport.cuda_kernels import CudaDriver, copy_kernels
from pdkv.transport.host import WatchedPeers, host_id, ipc_session
from pdkv.transport.ipc_chunks import CHUNK_BYTES, SpanMap, block_array, plan_chunks
from pdkv.transport.ipc_share import KvExporter, OpenedPeer, close_opened, open_export
from pdkv.transport.descriptors import check_ranges, plan_descriptors

__all__ = ["CudaIpcTransport", "IpcAllocation", "IpcExport", "IpcRegion", "SpanMap", "plan_chunks"]

log = logging.getLogger(__name__)

GRAPH_BLOCK_STEP = 16
MAX_GRAPHS = 64


class _BlockGraph:
    """A captured CUDA graph: upload the (bases, block ids) table from pinned memory, then the block kernel.

    Replaying it costs a few microseconds where a Triton launch from Python costs a hundred or more. `device`, the
    table the kernel reads, lives as long as the graph: a graph holds no tensor, and a table freed after capture
    is the engine's next tensor of that size, which each replay overwrote (P died of a device-side assert).
    """

    def __init__(self, host: Any, device: Any, graph: Any) -> None:
        self.host, self.device, self.graph = host, device, graph


class _RegionLayout(msgspec.Struct, frozen=True):
    regions: int
    block_len: int
    local_blocks: int
    remote_blocks: int
    bases: Any  # int64 array: local region bases, then remote ones translated into this process


class _Peer(msgspec.Struct):
    spans: SpanMap
    opened: OpenedPeer
    device: int  # the peer memory's GPU, as numbered in this process
    layouts: dict = msgspec.field(default_factory=dict)
    last: tuple | None = None  # (local list, remote list, layout) of the previous write


class CudaIpcTransport(UncheckedWrites):
    """Transport for P and D on one host: `hello()` (its `export()`) on D, `connect()` then `write_blocks()` on P.

    `device` is this process's GPU. With `pull` (the default) the copy kernel
    runs on the peer's GPU and reads this GPU over NVLink, which measured
    faster than pushing writes from here; that needs both GPUs visible in this
    process. Opened handles are closed by `close()` (or leaving the `with`
    block) and when a peer is reconnected.
    """

    name = "ipc"

    def __init__(self, device: int = 0, *, pull: bool = True, chunk_bytes: int = CHUNK_BYTES) -> None:
        import torch

        if not torch.cuda.is_available():
            raise StartError("no CUDA device visible", hint="the ipc transport needs GPUs; use --transport tcp or rdma")
        self.torch = torch
        self.device = device
        self.pull = pull
        self.chunk_bytes = chunk_bytes
        torch.cuda.set_device(device)
        torch.cuda.init()
        self.driver = CudaDriver()
        self._local: list[tuple[int, int]] = []
        self._local_map = SpanMap([])
        self._peers: dict[str, _Peer] = {}  # guarded by _lock, as is every field below
        self._exports: dict[str, IpcExport] = {}  # peer -> the export its open handles came from
        self._watched = WatchedPeers()  # the processes of _peers, and why writes to exited ones fail
        self._streams: dict[int, Any] = {}
        self._staging: dict[int, tuple[Any, Any]] = {}  # device -> (pinned host, device) int64 tables
        self._graphs: dict[tuple[int, int, int, int], _BlockGraph] = {}
        self._lock = threading.RLock()  # one write at a time: graphs and staging buffers are shared
        uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
        self._exporter = KvExporter(self.driver, device, uuid)  # D: one export per registered set (guarded by _lock)
        self.profile = False
        self.last_kernel_ms: float | None = None

    @property
    def session_address(self) -> str:
        return ipc_session(os.getpid(), self.device)

    @property
    def peers(self) -> list[str]:
        """The peers whose handles are open."""
        with self._lock:
            return list(self._peers)

    def register(self, regions: list[tuple[int, int]]) -> None:
        with self._lock:
            self._local.extend(regions)
            self._local_map = SpanMap([(a, a + n, a) for a, n in self._local])
            self._exporter.drop()

    def unregister(self, regions: list[tuple[int, int]]) -> None:
        gone = set(regions)
        with self._lock:
            self._local = [r for r in self._local if r not in gone]
            self._local_map = SpanMap([(a, a + n, a) for a, n in self._local])
            self._exporter.drop()

    def _bind_thread(self) -> None:
        """Make this process's GPU current on the calling thread: driver calls need a context, and callers use thread pools."""
        self.torch.cuda.set_device(self.device)

    def export(self) -> IpcExport:
        """Handles for the allocations behind every registered region (only those regions are writable by P):
        a CUDA IPC handle for memory from cudaMalloc (torch's allocator), a file descriptor served to P
        (fd_share) for a CUDA VMM allocation. Made once per registered set: the descriptors stay open with it."""
        with self._lock:
            self._bind_thread()
            return self._exporter.make(self._local)

    @property
    def settings(self) -> dict[str, str]:
        return {}

    def hello(self) -> IpcExport:
        return self.export()

    def connect(self, peer: str, hello: IpcExport | None) -> None:
        """Open `hello`'s handles, once per export; `peer` is the name later writes use. Handles of peers
        whose process is gone are closed first (a restarted D exports anew)."""
        if hello is None:
            raise TransferError("decode sent no CUDA IPC handles, but this engine moves KV with ipc",
                                hint="use the same mooncake_protocol on P and D")
        with self._lock:
            if self._exports.get(peer) == hello:
                return
            self._watched.sweep(self._disconnect)  # a restarted D exports anew: the dead one's handles close
            self._connect(peer, hello)
            self._exports[peer] = hello

    def _connect(self, peer: str, export: IpcExport) -> None:
        self._bind_thread()
        if export.host_id != host_id():
            raise TransferError(f"peer {peer} is on another host ({export.host_id}); CUDA IPC works within one host")
        if export.pid == os.getpid():
            raise TransferError("CUDA IPC cannot open handles exported by the same process")
        self._disconnect(peer)
        self._watched.watch(peer, export.pid, export.start_time)
        opened = OpenedPeer()
        try:
            opened = open_export(self.driver, export, self.device)
            try:
                spans = [opened.span(export, region) for region in export.regions]
            except TransferError as e:
                raise TransferError(f"peer {peer} exported a region it cannot be written in: {e}") from None
            peer_device = self.driver.device_of(opened.pointers[0]) if opened.pointers else self.device
            if self.pull and peer_device != self.device:
                self.driver.enable_peer_access(peer_device, self.device)
        except TransferError:
            close_opened(self.driver, opened)
            self._watched.forget(peer)
            raise
        self._peers[peer] = _Peer(SpanMap(spans), opened, peer_device)
        self._warm_up(self._launch_device(peer))

    def _launch_device(self, peer: str) -> int:
        return self._peers[peer].device if self.pull else self.device

    def _stream(self, device: int):
        if device not in self._streams:
            self._streams[device] = self.torch.cuda.Stream(device)
        return self._streams[device]

    def _upload(self, device: int, table) -> Any:
        """Copy an int64 table to `device` through reusable pinned memory (allocating pinned memory per call costs more than the copy)."""
        torch = self.torch
        n = table.size
        host, dev = self._staging.get(device, (None, None))
        if host is None or host.numel() < n:
            size = max(n, 16384)
            host = torch.empty(size, dtype=torch.int64).pin_memory()
            dev = torch.empty(size, dtype=torch.int64, device=f"cuda:{device}")
            self._staging[device] = (host, dev)
        host.numpy()[:n] = table.reshape(-1)
        dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n]

    def _run(self, device: int, launch) -> None:
        """Run `launch()` on `device`'s stream and wait; with `profile`, time the kernel with CUDA events."""
        torch = self.torch
        stream = self._stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            if self.profile:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                launch()
                end.record(stream)
            else:
                launch()
        stream.synchronize()
        if self.profile:
            self.last_kernel_ms = start.elapsed_time(end)

    def _block_graph(self, device: int, nr: int, nb: int, block_len: int) -> _BlockGraph:
        key = (device, nr, nb, block_len)
        cached = self._graphs.pop(key, None)
        if cached is None:
            torch = self.torch
            chunks = -(-block_len // self.chunk_bytes)
            host = torch.zeros(2 * nr + 2 * nb, dtype=torch.int64).pin_memory()
            dev = torch.zeros(2 * nr + 2 * nb, dtype=torch.int64, device=f"cuda:{device}")
            kernel = copy_kernels()["blocks"]
            grid = (nr * nb * chunks,)
            args = (dev[:nr], dev[nr : 2 * nr], dev[2 * nr : 2 * nr + nb], dev[2 * nr + nb :], nb, chunks, block_len)
            meta = {"CHUNK_WORDS": self.chunk_bytes // 8, "BLOCK": 1024, "num_warps": 4}
            graph = torch.cuda.CUDAGraph()
            stream = self._stream(device)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                kernel.warmup(*args, grid=grid, **meta)
                # thread_local: in "global" mode the engine's model thread failed (stream is capturing): P died.
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    dev.copy_(host, non_blocking=True)
                    kernel[grid](*args, **meta)
            cached = _BlockGraph(host, dev, graph)
            while len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = cached
        return cached

    def _warm_up(self, device: int) -> None:
        """Compile and load both kernels now, so a request's first transfer does not pay for it."""
        import numpy as np

        torch = self.torch
        scratch = torch.zeros(256, dtype=torch.uint8, device=f"cuda:{device}")
        base = scratch.data_ptr()
        self._launch_chunks(device, np.array([[base, base + 128, 128]], dtype=np.int64))
        bases = torch.tensor([base], dtype=torch.int64, device=f"cuda:{device}")
        blocks = torch.tensor([0], dtype=torch.int64, device=f"cuda:{device}")
        kernel = copy_kernels()["blocks"]
        words = self.chunk_bytes // 8
        self._run(device, lambda: kernel[(1,)](bases, bases + 128, blocks, blocks, 1, 1, 128, CHUNK_WORDS=words, BLOCK=1024, num_warps=4))

    def write(self, peer: str, descriptors: list[Descriptor], *, transfer: str = "") -> None:
        with self._watched.holding(self._lock, peer, self._disconnect):
            self._write(peer, descriptors)

    def _write(self, peer: str, descriptors: list[Descriptor]) -> Written:
        self._bind_thread()
        entry = self._require(peer)
        chunks = plan_chunks(descriptors, self._local_map, entry.spans, self.chunk_bytes)
        if len(chunks):
            self._launch_chunks(self._launch_device(peer), chunks)
            self._watched.check(peer, self._disconnect)  # bytes that reached a dead D reached no one
        return Written(sum(d.length for d in descriptors), len(descriptors))

    def write_blocks(self, peer: str, local_blocks, remote_blocks, local_regions, remote_regions, heads=None, *, transfer="") -> Written:
        """Copy whole blocks with one kernel that computes addresses on the GPU; return what moved (bytes, block copies).

        Checks, before any copy: block ids inside both sides' regions, each local region inside registered memory, each
        remote region inside the peer's exported memory, equal block lengths; a `heads` share (unequal TP) goes to the
        chunk kernel as planned descriptors, each range checked (plan_chunks). Safe to call from several threads."""
        with self._watched.holding(self._lock, peer, self._disconnect):
            if heads is not None and not heads.whole:
                return self._write(peer, plan_descriptors(local_blocks, remote_blocks, local_regions, remote_regions, heads=heads))
            return self._write_blocks(peer, local_blocks, remote_blocks, local_regions, remote_regions)

    def _write_blocks(self, peer: str, local_blocks, remote_blocks, local_regions, remote_regions) -> Written:
        import numpy as np

        self._bind_thread()
        check_ranges(list(local_blocks), list(remote_blocks), local_regions, remote_regions)
        if not len(local_blocks) or not local_regions:
            return Written(0, 0)
        layout = self._region_layout(peer, local_regions, remote_regions)
        lblk = block_array(local_blocks, layout.local_blocks, "local")
        rblk = block_array(remote_blocks, layout.remote_blocks, "remote")
        device = self._launch_device(peer)
        nr, nb, block_len = layout.regions, len(lblk), layout.block_len
        # Pad the block list to a multiple of GRAPH_BLOCK_STEP by repeating its last pair (the same
        # bytes written twice to the same place), so a few captured CUDA graphs serve every request length.
        padded = -(-nb // GRAPH_BLOCK_STEP) * GRAPH_BLOCK_STEP
        lblk = np.concatenate([lblk, np.full(padded - nb, lblk[-1], np.int64)])
        rblk = np.concatenate([rblk, np.full(padded - nb, rblk[-1], np.int64)])
        graph = self._block_graph(device, nr, padded, block_len)
        graph.host.numpy()[:] = np.concatenate([layout.bases, lblk, rblk])
        self._run(device, graph.graph.replay)
        self._watched.check(peer, self._disconnect)  # bytes that reached a dead D reached no one
        return Written(nr * nb * block_len, nr * nb)

    def _region_layout(self, peer: str, local_regions: Sequence[Region], remote_regions: Sequence[Region]) -> _RegionLayout:
        """Check a region pairing once (bounds, block lengths) and keep the translated bases for later requests.

        The same list objects as last time skip even the lookup: a connector
        passes its fixed region lists on every request. Block ids are still
        checked on every write, against the regions as they were checked here.
        """
        import numpy as np

        entry = self._require(peer)
        last = entry.last
        if last is not None and last[0] is local_regions and last[1] is remote_regions:
            return last[2]
        key = (tuple(local_regions), tuple(remote_regions))
        cached = entry.layouts.get(key)
        if cached is not None:
            entry.last = (local_regions, remote_regions, cached)
            return cached
        if len(local_regions) != len(remote_regions):
            raise TransferError(f"{len(local_regions)} local regions cannot pair with {len(remote_regions)} remote regions")
        block_len = local_regions[0].block_len
        if any(r.block_len != block_len for r in (*local_regions, *remote_regions)):
            raise TransferError("every region must have the same block length for a block copy")
        if block_len % 16:
            raise TransferError(f"block length {block_len} is not a multiple of 16 bytes")
        lbase = np.array([r.base for r in local_regions], dtype=np.int64)
        rbase = np.array([r.base for r in remote_regions], dtype=np.int64)
        self._local_map.translate_many(lbase, np.array([r.size for r in local_regions], dtype=np.int64), "local")
        rmapped = entry.spans.translate_many(rbase, np.array([r.size for r in remote_regions], dtype=np.int64), "remote")
        layout = _RegionLayout(
            regions=len(local_regions),
            block_len=block_len,
            local_blocks=min(r.num_blocks for r in local_regions),
            remote_blocks=min(r.num_blocks for r in remote_regions),
            bases=np.concatenate([lbase, rmapped]),
        )
        if len(entry.layouts) >= 16:
            entry.layouts.clear()
        entry.layouts[key] = layout
        entry.last = (local_regions, remote_regions, layout)
        return layout

    def _require(self, peer: str) -> _Peer:
        self._watched.check(peer, self._disconnect)
        try:
            return self._peers[peer]
        except KeyError:
            raise TransferError(f"no CUDA IPC session with {peer}", hint="connect the peer's export first") from None

    def _launch_chunks(self, device: int, chunks) -> None:
        table = chunks.copy()
        table[:, 2] //= 8
        with self.torch.cuda.stream(self._stream(device)):
            dev = self._upload(device, table)
        kernel = copy_kernels()["chunks"]
        self._run(device, lambda: kernel[(len(chunks),)](dev, 3, CHUNK_WORDS=self.chunk_bytes // 8, BLOCK=1024, num_warps=4))

    def disconnect(self, peer: str) -> None:
        with self._lock:
            self._disconnect(peer)

    def _disconnect(self, peer: str) -> None:
        self._bind_thread()
        self._exports.pop(peer, None)
        entry = self._peers.pop(peer, None)
        self._watched.forget(peer)
        if entry is not None:
            for stream in self._streams.values():
                stream.synchronize()
            close_opened(self.driver, entry.opened)

    def close(self) -> None:
        with self._lock:
            for peer in list(self._peers):
                self._disconnect(peer)
            self._graphs.clear()
            self._exporter.drop()

    def __enter__(self) -> CudaIpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

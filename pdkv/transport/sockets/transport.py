"""The Transport protocol over TCP sockets of pdkv's own (`socket`): KV at the speed of the link where there is no
RDMA, for KV in host memory and (staged through pinned buffers) on GPUs.

D listens on its advertised address (`port`; 0: a free one) and lets be written only what it granted a transfer
(`expect`, from the pulls it sends; `forget` when the pull concludes); P keeps `connections` connections to each D
and splits every transfer over them. The session address a peer writes to is `socket://host:port/<session id>`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pdkv.auth import token_from_env
from pdkv.errors import TransferError, UsageError
from pdkv.tp_heads import HeadShare
from pdkv.transport.base import Descriptor, Written
from pdkv.transport.descriptor_writes import DescriptorWrites
from pdkv.transport.sockets import send_wire, wire
from pdkv.transport.sockets.lanes import PeerLanes
from pdkv.transport.sockets.listener import SocketListener
from pdkv.transport.sockets.send_process import SendProcess
from pdkv.transport.sockets.staging import DEFAULT_CHUNK_BYTES, ENGINES
from pdkv.transport.sockets.streams import HostMemory, HostSpans
from pdkv.wire import Region

log = logging.getLogger(__name__)

DEFAULT_CONNECTIONS = 4  # per D at most by default, and no more than this process's cores: docs/socket.md measures it
# Each connection's socket buffers (the kernel doubles them): small enough that a write's bytes stay in the CPU's
# caches between the two copies (docs/bench.md: between two namespace hosts on 2 cores 256 KiB was 1.5-1.8x slower,
# on loopback 10% faster). Four connections of them keep about 0.75 MiB in flight: a 100 Gb/s link's
# bandwidth-delay product at 60 us. Longer or faster paths want more (`socket_buffer_bytes`); 0: autotuning.
DEFAULT_BUFFER_BYTES = 96 << 10
MAX_CONNECTIONS = 64
MIN_BUFFER_BYTES, MAX_BUFFER_BYTES = 4096, 1 << 30


def buffer_bytes_problem(n: int) -> str | None:
    """What is wrong with `n` as each connection's socket buffer size, or None when it will do (0: autotuning)."""
    if n == 0 or MIN_BUFFER_BYTES <= n <= MAX_BUFFER_BYTES:
        return None
    return f"must be 0 (the kernel's autotuning) or {MIN_BUFFER_BYTES}..{MAX_BUFFER_BYTES} bytes, got {n}"
DEFAULT_WRITE_TIMEOUT_S = 30.0
MAX_PEERS = 64  # D engines one P keeps connections to; past it the least recently written loses them


def default_connections() -> int:
    """Connections per D when none are asked for: DEFAULT_CONNECTIONS, but no more than the cores this process may
    run on (each connection's copies keep a core busy; on 2 cores 2 connections moved the most)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(DEFAULT_CONNECTIONS, cores))


class SocketTransport(DescriptorWrites):
    """Implements pdkv.transport.base.Transport over TCP. Every method may be called from several threads at once:
    `_lock` guards the peer table and the registered spans (replaced whole); the grants guard themselves."""

    name = "socket"

    def __init__(
        self, hostname: str = "127.0.0.1", *, port: int = 0, gpu: int | None = None, writable: bool = True,
        connections: int = 0, write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        token: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        staging: str | None = None, send_process: bool = False,
    ) -> None:
        """`writable`: peers write into this process (D); `gpu`: the KV lives on that CUDA device (staged through
        pinned host buffers); `connections` to each D (0: default_connections()); `token`: the deployment key
        (default PDKV_TOKEN); `buffer_bytes`: each connection's socket buffer (0: the kernel's autotuning);
        `staging`: how GPU memory moves to and from the pinned buffers (staging.ENGINES; None: the kernel where
        P's own threads stage, beside its forward, the copy engines in the send process and on D);
        `send_process`: P's writes of GPU memory run in a child process (send_process.py)."""
        connections = connections or default_connections()
        if not 1 <= connections <= MAX_CONNECTIONS:
            raise UsageError(f"socket connections must be 1..{MAX_CONNECTIONS}, got {connections}")
        if problem := buffer_bytes_problem(buffer_bytes):
            raise UsageError(f"the socket buffer size {problem}")
        if write_timeout_s <= 0:
            raise UsageError(f"write timeout must be positive, got {write_timeout_s}")
        if staging is not None and staging not in ENGINES:
            raise UsageError(f"socket staging must be one of {', '.join(ENGINES)}, got {staging!r}")
        self.send_process = send_process and gpu is not None and not writable
        # The copy kernel holds its thread to a few calls a batch, which matters only beside P's forward in P's own
        # process; the copy engines leave the GPU's SMs to the forward of every other process (docs/socket.md).
        self.staging = staging or ("kernel" if not writable else "copies")
        self._child_staging = staging or "copies"
        self._token = token
        self._sender: Any = None  # the send process (guarded by _lock), started at the first register
        self._exporter: Any = None  # its view of this process's memory (KvExporter, guarded by _lock)
        self.hostname = hostname
        self.connections = connections
        self.write_timeout_s = write_timeout_s
        self.gpu = gpu
        self.chunk_bytes = chunk_bytes
        self.buffer_bytes = buffer_bytes
        self._key = wire.handshake_key(token if token is not None else token_from_env())
        self.grants = wire.Grants()
        self._lock = threading.Lock()
        self._raw: list[tuple[int, int]] = []  # registered (address, length), as given; replaced whole under _lock
        self._spans = wire.Spans()  # the same merged; ditto
        self._host = HostSpans([])  # the same as memoryviews, for host memory; ditto
        self._peers: OrderedDict[str, PeerLanes] = OrderedDict()  # guarded by _lock
        self._closed = False
        self.listener = (
            SocketListener(hostname, port, self.grants, key=self._key, memory=self._memory, progress_timeout_s=write_timeout_s,
                           buffer_bytes=buffer_bytes)
            if writable else None
        )
        at = f"[{hostname}]" if ":" in hostname else hostname
        self._session = f"socket://{at}:{self.listener.port}/{self.listener.session_id.hex()}" if self.listener else ""

    def _memory(self) -> Any:
        if self.gpu is None:
            return HostMemory(lambda: self._host)
        from pdkv.transport.sockets.staging import CudaStaging

        return CudaStaging(self.gpu, self.chunk_bytes, self.staging)

    # -- Transport protocol --
    @property
    def session_address(self) -> str:
        return self._session

    @property
    def settings(self) -> dict[str, str]:
        sender = self._sender
        return {"connections": str(self.connections), "socket_buffer_bytes": str(self.buffer_bytes),
                "staging": f"{self.chunk_bytes >> 20} MiB x 2, {self.staging}" if self.gpu is not None else "none",
                **({"send_process": sender.state} if sender is not None else {})}

    def register(self, regions: list[tuple[int, int]]) -> None:
        with self._lock:
            self._set_spans([*self._raw, *((int(a), int(n)) for a, n in regions if n > 0)])
            self._share()

    def unregister(self, regions: list[tuple[int, int]]) -> None:
        gone = {(int(a), int(n)) for a, n in regions}
        with self._lock:
            self._set_spans([s for s in self._raw if s not in gone])
            self._share()

    def expect(self, transfer: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Let peers write `ranges` of this process's registered memory under `transfer`, until `forget(transfer)`."""
        bad = self._spans.outside(ranges)
        if bad is not None:
            raise TransferError(f"cannot expect a write of {bad[0]:#x}+{bad[1]}: it is outside the registered memory")
        self.grants.grant(transfer, ranges)

    def forget(self, transfer: str) -> None:
        self.grants.revoke(transfer)

    def write(self, peer: str, descriptors: Sequence[Descriptor], *, transfer: str = "", timeout_s: float | None = None) -> None:
        """Write every descriptor into `peer` under `transfer` (what D granted it); return once all bytes have landed."""
        if self._closed:
            raise TransferError("the socket transport is closed")
        if not descriptors:
            return
        ranges = [(d.src, d.dst, d.length) for d in descriptors]
        bad = self._spans.outside((src, n) for src, _, n in ranges)
        if bad is not None:
            raise TransferError(f"local range 0x{bad[0]:x}+{bad[1]} is outside the registered memory")
        total = sum(n for _, _, n in ranges)
        sender = self._sender
        if sender is not None and sender.ready:
            landed = sender.write(peer, transfer, ranges, self.write_timeout_s if timeout_s is None else timeout_s)
        else:
            landed = self._lanes(peer).write(transfer, ranges, timeout_s)
        if landed != total:
            raise TransferError(f"decode acknowledged {landed:,} of {total:,} B")

    def write_blocks(
        self, peer: str, local_blocks: list[int], remote_blocks: list[int], local_regions: list[Region], remote_regions: list[Region],
        heads: HeadShare | None = None, *, transfer: str = "",
    ) -> Written:
        """As every descriptor transport's; with a send process ready, the child plans the descriptors too (P's
        thread checks only that each of its regions lies in the registered memory)."""
        sender = self._sender
        if sender is None or not sender.ready:
            return super().write_blocks(peer, local_blocks, remote_blocks, local_regions, remote_regions, heads, transfer=transfer)
        if self._closed:
            raise TransferError("the socket transport is closed")
        bad = self._spans.outside((r.base, r.block_len * r.num_blocks) for r in local_regions)
        if bad is not None:
            raise TransferError(f"local region 0x{bad[0]:x}+{bad[1]} is outside the registered memory")
        landed, descriptors = sender.write_blocks(peer, transfer, list(local_blocks), list(remote_blocks), list(local_regions),
                                                  list(remote_regions), heads, self.write_timeout_s)
        return Written(landed, descriptors)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), OrderedDict()
            sender, self._sender = self._sender, None
            if self._exporter is not None:
                self._exporter.drop()
        if sender is not None:
            sender.close()
        for p in peers:
            p.close()
        if self.listener is not None:
            self.listener.close()
        self.grants.clear()

    def __enter__(self) -> SocketTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --
    def _set_spans(self, spans: list[tuple[int, int]]) -> None:
        self._raw = sorted(set(spans))
        self._spans = wire.Spans(self._raw)
        if self.gpu is None:
            self._host = HostSpans(self._spans.spans)

    def await_send_process(self, timeout_s: float) -> str:
        """Wait up to `timeout_s` for the send process to start: "ready", "off" (none), or why it cannot write or
        "starting". Writes never wait for it (P writes in its own process meanwhile); a benchmark does."""
        sender = self._sender
        return sender.wait(timeout_s) if sender is not None else "off"

    def _share(self) -> None:
        """P with a send process: (re)export the registered memory to it, starting it the first time. Where the
        memory cannot be exported, P writes in its own process (logged). Under _lock."""
        if not self.send_process or self._closed or (not self._raw and self._sender is None):
            return
        from pdkv.transport.cuda_kernels import CudaDriver  # the GPU path's, as the ipc transport's
        from pdkv.transport.ipc_share import KvExporter

        try:
            if self._exporter is None:
                import torch

                uuid = str(getattr(torch.cuda.get_device_properties(self.gpu), "uuid", ""))
                self._exporter = KvExporter(CudaDriver(), self.gpu, uuid)
            self._exporter.drop()
            export = self._exporter.make(self._raw)
            if self._sender is None:
                self._sender = SendProcess(send_wire.Setup(
                    self.gpu, self.connections, self.write_timeout_s, self.buffer_bytes, self.chunk_bytes,
                    self._child_staging, int(sys.getswitchinterval() * 1e6), self._token))
            self._sender.share(export)
        except Exception as exc:  # CUDA or the export: the writes stay in this process, as without a send process
            log.warning("pdkv: the socket send process cannot reach this KV memory (%s); P writes in its own process", exc)
            self.send_process = False
            if self._sender is not None:
                self._sender.close()
                self._sender = None

    def _lanes(self, peer: str) -> PeerLanes:
        with self._lock:
            lanes = self._peers.get(peer)
            if lanes is not None:
                self._peers.move_to_end(peer)
                return lanes
        fresh = PeerLanes(peer, self._key, self.connections, self._memory, self.write_timeout_s, self.buffer_bytes)
        evicted: list[PeerLanes] = []
        with self._lock:
            lanes = self._peers.get(peer)
            if lanes is None and not self._closed:
                lanes = self._peers[peer] = fresh
                while len(self._peers) > MAX_PEERS:
                    evicted.append(self._peers.popitem(last=False)[1])
        for old in evicted:
            old.close()
        if lanes is not fresh:
            fresh.close()
        if lanes is None:
            raise TransferError("the socket transport is closed")
        return lanes

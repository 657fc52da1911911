"""The Transport protocol over Mooncake's TransferEngine, for `tcp` and `rdma`.

Peers find each other with Mooncake's P2P handshake (no metadata server): a
transport listens on `hostname:<rpc port>` and that string, `session_address`,
is what a peer passes to `write`.

Mooncake reads its `MC_*` settings from the environment, so `settings` are
applied to `os.environ` before the engine module is imported and before
`initialize`. MC_LOG_LEVEL is read once, at that first import: later
transports in the same process keep the first level. The settings users need
(docs/bench.md lists them too):

    MC_LOG_LEVEL                 INFO (Mooncake's default), WARNING or ERROR
    MC_TCP_BIND_ADDRESS          interface the tcp data listener binds
    MC_MIN_RPC_PORT/MC_MAX_RPC_PORT  range the handshake port is drawn from (firewalls)
    MC_HANDSHAKE_CONNECT_TIMEOUT bound on connecting to a peer's handshake port
    MC_TRANSFER_TIMEOUT          seconds before an rdma transfer is failed
    MC_TCP_PROGRESS_TIMEOUT_SEC  seconds a tcp transfer may make no progress
    MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER  requests one peer may have queued (see max_batch)
    MC_SLICE_SIZE, MC_TCP_SLICE_SIZE  bytes per slice a transfer is cut into
    MC_GID_INDEX, MC_IB_PORT, MC_MTU  rdma: RoCE GID, HCA port, path MTU
    MC_FORCE_TCP                 use tcp even where rdma devices exist
    MC_TE_METRIC                 1 to have Mooncake log its own throughput

Why writes run on worker threads: a peer that accepts the handshake
connection but never answers (a stopped process) blocks Mooncake's handshake
for 60 s, and no `MC_*` setting shortens that read. The worker lets `write`
raise TransferError after `write_timeout_s`; the stalled call is abandoned
and `close()` waits for it, bounded, before unregistering memory. Until
`close()` returns the caller must keep the source memory alive. A write
whose caller stopped waiting before it reached Mooncake (queued behind the
stalled one) is never started: its caller was told it failed, and the peer
may have given those blocks to another request since. The stalled call
itself cannot be called back, and may land once the peer resumes.

Each peer has a worker of its own, so a stalled or slow D delays only the
writes to that D; writes to one peer run one after another, in the order
they were asked for. A worker left idle for `IDLE_WORKER_S` ends, so a fleet
whose D engines come and go keeps no thread per departed D.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from pdkv.errors import StartError, TransferError, UsageError
from pdkv.transport.base import Descriptor, UncheckedWrites
from pdkv.transport.descriptor_writes import DescriptorWrites

PROTOCOLS = ("tcp", "rdma")
DEFAULT_WRITE_TIMEOUT_S = 30.0
DEFAULT_CLOSE_TIMEOUT_S = 5.0
# Mooncake 0.3's tcp transport fails a whole batch (rc -1, "TCP lane queue-full
# rejection") once one call queues more than MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER
# requests for a peer (2048 by default): 2268 per-block descriptors of one
# 63-block Qwen3-8B request already do. Writes are cut into calls of at most
# this many descriptors; measured on loopback tcp, the cut costs no time.
DEFAULT_MAX_BATCH = 1024
SYSFS_INFINIBAND = "/sys/class/infiniband"
IDLE_WORKER_S = 60.0


def apply_mc_settings(settings: Mapping[str, str] | None) -> dict[str, str]:
    """Put `settings` into os.environ (Mooncake reads them there) and return every MC_* now in effect.

    Only MC_* keys are accepted: anything else is a typo that Mooncake would silently ignore.
    """
    for key, value in (settings or {}).items():
        if not key.startswith("MC_") or not key[3:].replace("_", "").isalnum():
            raise UsageError(f"{key!r} is not a Mooncake setting", hint="Mooncake settings are named MC_*, e.g. MC_LOG_LEVEL")
        os.environ[key] = str(value)
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MC_")}


def rdma_devices(sysfs_root: str | Path = SYSFS_INFINIBAND) -> list[str]:
    """Names of the RDMA devices the kernel exposes (mlx5_0, ...), empty where none."""
    root = Path(sysfs_root)
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def check_mooncake_transport(transport: str, device_name: str, sysfs_root: str | Path = SYSFS_INFINIBAND) -> None:
    """Refuse what Mooncake would accept and then quietly do differently.

    Mooncake 0.3 returns success for an unknown protocol (its word for `transport`), and for `rdma` on a
    host without RDMA devices it falls back to tcp; a benchmark or a
    deployment would then measure the wrong link.
    """
    if transport not in PROTOCOLS:
        raise UsageError(f"transport {transport!r} is not one of Mooncake's", hint=f"use one of: {', '.join(PROTOCOLS)}")
    if transport != "rdma":
        return
    found = rdma_devices(sysfs_root)
    if not found:
        raise StartError(
            f"transport rdma asked for, but {sysfs_root} lists no RDMA devices",
            hint="load the NIC's driver (ibv_devices should list it) or use --transport tcp",
        )
    wanted = [d.strip() for d in device_name.split(",") if d.strip()]
    missing = [d for d in wanted if d not in found]
    if missing:
        raise StartError(
            f"RDMA device {', '.join(missing)} not found",
            hint=f"devices on this host: {', '.join(found)}",
        )


def link_gbps_of(device_name: str, sysfs_root: str | Path = SYSFS_INFINIBAND) -> float | None:
    """The link rate of an RDMA device's port 1 in Gb/s, from sysfs ("400 Gb/sec (4X NDR)"), or None."""
    first = device_name.split(",")[0].strip()
    if not first:
        return None
    try:
        text = (Path(sysfs_root) / first / "ports" / "1" / "rate").read_text()
        return float(text.split()[0])
    except (OSError, ValueError, IndexError):
        return None


class _Worker:
    """One daemon thread that runs one peer's blocking engine calls, so that the caller can stop waiting.

    It ends after `idle_s` without work; `submit` then returns None and the
    caller starts a new worker. `lock` is the transport's: it orders a
    submit against the worker's decision to end.
    """

    def __init__(self, name: str, lock: threading.Lock, idle_s: float = IDLE_WORKER_S) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = lock
        self._idle_s = idle_s
        self.ended = False  # guarded by the transport's lock
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self.ended = True
                        return
                continue
            if job is None:
                return
            fut, fn = job
            if not fut.set_running_or_notify_cancel():
                continue  # its caller stopped waiting before it started: it must never start
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> Future[Any] | None:
        """Queue `fn`; None if this worker has ended. Call with the transport's lock held."""
        if self.ended:
            return None
        fut: Future[Any] = Future()
        self._jobs.put((fut, fn))
        return fut

    def retire(self) -> None:
        self._jobs.put(None)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


class MooncakeTransport(DescriptorWrites, UncheckedWrites):
    """A Mooncake TransferEngine started with the P2P handshake; implements pdkv.transport.base.Transport.

    Raises StartError when the engine cannot start (wheel missing, no RDMA
    device for `rdma`, initialize failing), UsageError for a transport
    Mooncake lacks or a non-MC_* setting. `transport` is what Mooncake calls the protocol: tcp or rdma.
    """

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        transport: str = "tcp",
        device_name: str = "",
        *,
        settings: Mapping[str, str] | None = None,
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        max_batch: int = DEFAULT_MAX_BATCH,
        sysfs_root: str | Path = SYSFS_INFINIBAND,
    ) -> None:
        check_mooncake_transport(transport, device_name, sysfs_root)
        if write_timeout_s <= 0:
            raise UsageError(f"write timeout must be positive, got {write_timeout_s}")
        if max_batch <= 0:
            raise UsageError(f"max_batch must be positive, got {max_batch}")
        self.max_batch = max_batch
        self.hostname = hostname
        self.name = transport
        self.device_name = device_name
        self.write_timeout_s = write_timeout_s
        self.mc_settings = apply_mc_settings(settings)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise StartError(
                f"cannot import Mooncake's TransferEngine: {exc}",
                hint="pip install mooncake-transfer-engine (GPU hosts) or mooncake-transfer-engine-non-cuda; "
                "it needs libibverbs1 and librdmacm1 even for tcp",
            ) from None
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", transport, device_name)
        if rc != 0:
            raise StartError(
                f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {transport}, {device_name!r}) returned {rc}",
                hint="check that the hostname is an address of this host and that the RPC port range is free "
                "(MC_MIN_RPC_PORT/MC_MAX_RPC_PORT); set MC_LOG_LEVEL=INFO to see Mooncake's reason",
            )
        port = self._engine.get_rpc_port()
        if port <= 0:
            raise StartError(f"Mooncake started without an RPC port (got {port})", hint="set MC_LOG_LEVEL=INFO and read its log")
        self._session = f"{hostname}:{port}"
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # guarded by _lock
        self._workers: dict[str, _Worker] = {}  # peer session -> its worker; guarded by _lock
        self._stalled: list[_Worker] = []  # abandoned after a timeout, joined by close(); guarded by _lock
        self._closed = False  # set under _lock

    # -- Transport -------------------------------------------------------

    @property
    def session_address(self) -> str:
        return self._session

    @property
    def settings(self) -> dict[str, str]:
        return self.mc_settings

    @property
    def engine(self) -> Any:
        """The underlying mooncake.engine.TransferEngine, for callers that measure it bare."""
        self._check_open()
        return self._engine

    def register(self, regions: Iterable[tuple[int, int]]) -> None:
        """Register (address, length) ranges; ranges already registered with the same length are skipped."""
        with self._lock:
            self._check_open()
            todo = [(int(a), int(n)) for a, n in regions if self._registered.get(int(a)) != int(n)]
            for addr, length in todo:
                if addr <= 0 or length <= 0:
                    raise TransferError(f"cannot register {length} B at {addr:#x}: address and length must be positive")
            if todo:
                self._register(todo)

    def _register(self, todo: list[tuple[int, int]]) -> None:
        rc = self._engine.batch_register_memory([a for a, _ in todo], [n for _, n in todo])
        if rc != 0:
            total = sum(n for _, n in todo)
            raise TransferError(
                f"Mooncake could not register {len(todo)} regions ({total:,} B), rc {rc}",
                hint="for rdma raise the locked-memory limit (ulimit -l unlimited) and check the device; "
                "GPU memory needs nvidia_peermem for rdma",
            )
        self._registered.update(todo)

    def unregister(self, regions: Iterable[tuple[int, int]]) -> None:
        with self._lock:
            self._check_open()
            addrs = [int(a) for a, _ in regions if int(a) in self._registered]
            if not addrs:
                return
            rc = self._engine.batch_unregister_memory(addrs)
            for a in addrs:
                self._registered.pop(a, None)
        if rc != 0:
            raise TransferError(f"Mooncake could not unregister {len(addrs)} regions, rc {rc}")

    def write(self, peer: str, descriptors: list[Descriptor], *, transfer: str = "", timeout_s: float | None = None) -> None:
        """Write every descriptor into `peer`'s registered memory; return once all bytes have landed.

        Descriptors go to Mooncake in calls of at most `max_batch`, one after another. `transfer` is not
        Mooncake's concern (D takes no part in the write).

        Raises TransferError, naming the peer and the byte count, when Mooncake
        reports a failure (peer gone, destination outside its registered
        memory) or when no answer comes within `timeout_s` (default
        `write_timeout_s`).
        """
        self._check_open()
        if peer.startswith(("cma:", "socket://")):
            # host:port parsing would accept it and Mooncake would try to resolve "cma:<boot id>".
            raise TransferError(
                f"decode's address {peer!r} is for {peer.split(':')[0]}, but this engine moves KV with Mooncake {self.name}: "
                "use the same mooncake_protocol on P and D"
            )
        if not descriptors:
            return
        srcs = [d.src for d in descriptors]
        dsts = [d.dst for d in descriptors]
        lens = [d.length for d in descriptors]
        engine, step = self._engine, self.max_batch

        def call() -> int:
            for i in range(0, len(lens), step):
                rc = engine.batch_transfer_sync_write(peer, srcs[i : i + step], dsts[i : i + step], lens[i : i + step])
                if rc != 0:
                    return rc
            return 0

        bound = self.write_timeout_s if timeout_s is None else timeout_s
        worker, fut = self._submit(peer, call)
        try:
            rc = fut.result(timeout=bound)
        except FutureTimeout:
            # A write still queued behind a stalled one is dropped; one already in Mooncake's hands may yet land.
            fut.cancel()
            with self._lock:
                # The stalled worker finishes (or times out inside Mooncake) on its own; later writes get a fresh one.
                if self._workers.get(peer) is worker:
                    del self._workers[peer]
                    worker.retire()
                    self._stalled = [w for w in self._stalled if w.running] + [worker]
            raise TransferError(
                f"write of {sum(lens):,} B in {len(lens)} descriptors to {peer} got no answer within {bound:g} s",
                hint="the peer accepts connections but does not answer: is its process stopped or overloaded?",
            ) from None
        except Exception as exc:  # pybind raises for ill-typed arguments
            raise TransferError(f"write of {sum(lens):,} B to {peer} failed: {exc}") from None
        if rc != 0:
            raise TransferError(
                f"write of {sum(lens):,} B in {len(lens)} descriptors to {peer} failed (Mooncake returned {rc})",
                hint="is the peer running, reachable, and are the destination ranges inside its registered memory? "
                "set MC_LOG_LEVEL=INFO for Mooncake's reason",
            )

    def _submit(self, peer: str, call: Callable[[], int]) -> tuple[_Worker, Future[Any]]:
        """Queue `call` on `peer`'s worker, starting one if it has none (or its worker just ended)."""
        with self._lock:
            self._check_open()
            worker = self._workers.get(peer)
            fut = worker.submit(call) if worker is not None else None
            if fut is None:
                worker = self._workers[peer] = _Worker(f"pdkv-mooncake-write {peer}", self._lock)
                fut = worker.submit(call)
            assert fut is not None
            return worker, fut

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Wait (bounded, `timeout_s` in all) for writes in flight and abandoned ones, unregister everything,
        and release the engine. Idempotent; writes asked for after it starts are refused."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = [*self._workers.values(), *self._stalled]
            self._workers.clear()
        for w in workers:
            w.retire()
        deadline = time.monotonic() + timeout_s
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
        if self._registered:
            try:
                self._engine.batch_unregister_memory(list(self._registered))
            finally:
                self._registered.clear()
        # Dropping the last reference shuts the engine's listeners down.
        self._engine = None

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the Mooncake transport is closed")

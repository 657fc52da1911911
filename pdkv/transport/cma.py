"""Intra-node host-memory transport: P writes straight into D's KV memory with process_vm_writev (`cma`).

Linux's cross-memory attach copies between two processes' address spaces in
one system call made by the writer alone: no thread of D's has to wake up,
no socket is crossed, and the bytes are copied once. It is what UCX and
NIXL use between processes of one host (their `cma` transport). For KV in
host memory (CPU hosts) on one machine it replaces Mooncake tcp over
loopback, whose write needs threads in both engines to be scheduled on
cores the engines keep busy.

The session address names the process to write into and proves it is the
same one: `cma:<boot id>:<pid>:<start time>`. The writer refuses an address
from another boot (another host) or whose pid now belongs to another process
(the start time differs), holds a pidfd per peer, and checks before every
write that the peer has not exited, so a recycled pid is never written.

Permissions are ptrace's: the writer needs the same user id as D (or
CAP_SYS_PTRACE). Where Yama's ptrace_scope is 1, D's transport allows any
process of its user to attach (prctl PR_SET_PTRACER_ANY); at 2 or 3 `cma`
cannot work and starting D's transport fails with a hint to use tcp.
"""

from __future__ import annotations

import bisect
import ctypes
import errno as errno_mod
import logging
import os
import threading
from array import array
from collections.abc import Sequence
from pathlib import Path

from pdkv.errors import StartError, TransferError
from pdkv.transport.base import Descriptor, UncheckedWrites
from pdkv.transport.host import PeerProcess, process_start_time, read_boot_id
from pdkv.transport.descriptor_writes import DescriptorWrites

__all__ = ["CmaTransport", "CmaPeer", "parse_session", "ptrace_scope", "process_start_time"]

log = logging.getLogger(__name__)

# The kernel takes at most IOV_MAX (1024) iovecs per call.
IOV_MAX = 1024
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = -1


def boot_id(proc_root: str | Path = "/proc") -> str:
    boot = read_boot_id(proc_root)
    if boot is None:
        raise StartError(f"cannot read the boot id under {proc_root}", hint="cma needs Linux with /proc mounted; use tcp")
    return boot


def ptrace_scope(proc_root: str | Path = "/proc") -> int | None:
    """Yama's ptrace_scope (0-3), or None where Yama is not enabled."""
    try:
        return int(Path(proc_root, "sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


def parse_session(session: str) -> tuple[str, int, int]:
    """(boot id, pid, start time) from `cma:<boot id>:<pid>:<start time>`; TransferError if malformed."""
    parts = session.split(":")
    if len(parts) != 4 or parts[0] != "cma":
        raise TransferError(f"{session!r} is not a cma session address: use the same mooncake_protocol on P and D")
    try:
        pid, start = int(parts[2]), int(parts[3])
    except ValueError:
        raise TransferError(f"{session!r} is not a cma session address (pid and start time are numbers)") from None
    if pid <= 0 or start < 0:
        raise TransferError(f"{session!r} names no process")
    return parts[1], pid, start


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc_writev():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_writev
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


class CmaPeer:
    """One process this transport writes into: its pid, watched through a pidfd (host.PeerProcess) so its exit is seen.

    Any number of transfer threads share one peer (PeerProcess guards its pidfd).
    """

    def __init__(self, session: str, own_boot: str) -> None:
        boot, pid, start = parse_session(session)
        if boot != own_boot:
            raise TransferError(
                f"decode process {pid} is on another host (boot id {boot[:8]}...)",
                hint="cma moves KV between processes of one host; use tcp or rdma across hosts",
            )
        self.pid = pid
        self._process = PeerProcess(pid, start, hint="cma needs P and D in one pid namespace; use tcp otherwise")

    def alive(self) -> bool:
        """False once the process has exited or this peer was closed."""
        return self._process.alive()

    def close(self) -> None:
        self._process.close()


class CmaTransport(DescriptorWrites, UncheckedWrites):
    """The Transport protocol over process_vm_writev, for KV in host memory of processes on one host.

    `write` copies on the calling thread and returns when every byte has
    landed; it never waits on the peer (the kernel copies into D's pages
    itself, no thread of D's takes part), so it needs no worker thread and no
    timeout. Every source range must lie in memory registered here. Writes
    may run from any number of threads at once, to one peer or several: the
    only state they share is the peer table and the span index (both swapped
    under `_lock`) and each peer's pidfd (guarded by the peer).
    """

    name = "cma"

    def __init__(self, proc_root: str | Path = "/proc", *, writable: bool = True) -> None:
        """`writable`: peers will write into this process (D); P's transport only writes and passes False."""
        scope = ptrace_scope(proc_root)
        if writable and scope is not None and scope >= 2:
            raise StartError(
                f"cma needs ptrace access between P and D, and kernel.yama.ptrace_scope is {scope}",
                hint="use mooncake_protocol tcp, or set kernel.yama.ptrace_scope to 0 or 1",
            )
        if writable and scope == 1:
            # Let P (not our ancestor) attach: any process of this user may, as with ptrace_scope 0.
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY & 0xFFFFFFFFFFFFFFFF), 0, 0, 0) != 0:
                raise StartError(f"prctl(PR_SET_PTRACER) failed: {os.strerror(ctypes.get_errno())}", hint="use mooncake_protocol tcp")
            log.info("cma: Yama ptrace_scope is 1; this process lets processes of its user write into it")
        self._boot = boot_id(proc_root)
        self._pid = os.getpid()
        self._session = f"cma:{self._boot}:{self._pid}:{process_start_time(self._pid, proc_root)}"
        self._writev = _libc_writev()
        self._lock = threading.Lock()
        # Sorted (address, length) of registered memory and their addresses (for bisect), swapped as one.
        self._index: tuple[list[tuple[int, int]], list[int]] = ([], [])  # replaced whole under _lock
        self._peers: dict[str, CmaPeer] = {}  # guarded by _lock
        self._closed = False

    # -- Transport protocol --
    @property
    def session_address(self) -> str:
        return self._session

    @property
    def settings(self) -> dict[str, str]:
        return {}

    def register(self, regions: list[tuple[int, int]]) -> None:
        with self._lock:
            self._set_spans(sorted({*self._index[0], *((int(a), int(n)) for a, n in regions if n > 0)}))

    def unregister(self, regions: list[tuple[int, int]]) -> None:
        gone = {(int(a), int(n)) for a, n in regions}
        with self._lock:
            self._set_spans([s for s in self._index[0] if s not in gone])

    def write(self, peer: str, descriptors: Sequence[Descriptor], *, transfer: str = "") -> None:
        """Copy every descriptor into `peer`'s memory; return once all bytes have landed, else raise TransferError."""
        if self._closed:
            raise TransferError("the cma transport is closed")
        if not descriptors:
            return
        target = self._peer(peer)
        self._check_local(descriptors)
        for start in range(0, len(descriptors), IOV_MAX):
            # Checked before every system call: the pid of a process that exited may name another one soon.
            if not target.alive():
                self._drop(peer, target)
                raise TransferError(f"decode process {target.pid} exited", hint="D died; its request fails there")
            self._writev_chunk(target.pid, descriptors[start : start + IOV_MAX])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            self._set_spans([])
        for p in peers:
            p.close()

    def __enter__(self) -> CmaTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --
    def _peer(self, session: str) -> CmaPeer:
        with self._lock:
            p = self._peers.get(session)
        if p is not None:
            return p
        p = CmaPeer(session, self._boot)  # reads /proc: outside the lock
        with self._lock:
            old = self._peers.get(session)
            if old is None and not self._closed:
                self._peers[session] = p
                return p
        p.close()
        if old is None:
            raise TransferError("the cma transport is closed")
        return old

    def _drop(self, session: str, peer: CmaPeer) -> None:
        """Forget `peer` (its process exited), unless another thread already put a new one in its place."""
        with self._lock:
            if self._peers.get(session) is peer:
                del self._peers[session]
        peer.close()

    def _set_spans(self, spans: list[tuple[int, int]]) -> None:
        self._index = (spans, [a for a, _ in spans])

    def _check_local(self, descriptors: Sequence[Descriptor]) -> None:
        spans, starts = self._index
        for d in descriptors:
            i = bisect.bisect_right(starts, d.src) - 1
            if d.length <= 0 or i < 0 or d.src + d.length > spans[i][0] + spans[i][1]:
                raise TransferError(f"local range 0x{d.src:x}+{d.length} is outside the registered memory")

    def _writev_chunk(self, pid: int, chunk: Sequence[Descriptor]) -> None:
        local = array("Q")
        remote = array("Q")
        total = 0
        try:
            for d in chunk:
                local.extend((d.src, d.length))
                remote.extend((d.dst, d.length))
                total += d.length
        except OverflowError:
            raise TransferError(f"a descriptor in {chunk[0]}.. has an address or length outside 0..2**64") from None
        n = self._writev(pid, local.buffer_info()[0], len(chunk), remote.buffer_info()[0], len(chunk), 0)
        if n == total:
            return
        err = ctypes.get_errno() if n < 0 else errno_mod.EFAULT
        if err == errno_mod.EPERM:
            raise TransferError(
                f"not allowed to write into decode process {pid}",
                hint="P and D must run as the same user (or P with CAP_SYS_PTRACE); use tcp otherwise",
            )
        if err == errno_mod.ESRCH:
            raise TransferError(f"decode process {pid} exited")
        raise TransferError(f"process_vm_writev into {pid} moved {max(n, 0)} of {total} bytes: {os.strerror(err)}")

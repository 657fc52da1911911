"""Which host, boot and process a peer is: what the host-local transports (cma, ipc) check a peer against.

`PeerProcess` watches a peer process of this host through a pidfd, so that a
transport writing into its memory sees its exit before the next write
(a CUDA IPC mapping of a dead process's memory still takes writes without an
error, and a recycled pid names another process).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from pdkv.errors import TransferError

log = logging.getLogger(__name__)


def host_id(proc_root: str | Path = "/proc") -> str:
    """This host's name and boot: two processes with the same host id can open each other's IPC handles."""
    return f"{socket.gethostname()}/{read_boot_id(proc_root) or 'unknown'}"


def read_boot_id(proc_root: str | Path = "/proc") -> str | None:
    """The kernel's boot id (new at every boot, so it tells hosts and reboots apart), or None where unreadable."""
    try:
        return Path(proc_root, "sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _stat_fields(pid: int, proc_root: str | Path = "/proc") -> list[str]:
    """Fields 3.. of /proc/<pid>/stat (the state first). Raises OSError."""
    stat = Path(proc_root, str(pid), "stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    return stat[stat.rindex(")") + 2 :].split()


def process_start_time(pid: int, proc_root: str | Path = "/proc") -> int:
    """Field 22 of /proc/<pid>/stat: when the process started, in clock ticks since boot. Raises OSError."""
    return int(_stat_fields(pid, proc_root)[19])


class PeerProcess:
    """A process of this host that this one writes into, held open as a pidfd so its exit is seen at once.

    `start_time` (process_start_time) proves the pid still names the process
    that sent its address: a pid reused by another process is refused. Where
    the kernel has no pidfd_open (before Linux 5.3, some sandboxes), `alive()`
    reads /proc/<pid>/stat instead (the pid with the same start time, not a
    zombie). Any number of threads share one peer: the pidfd is guarded by
    `_lock`, and `close()` never closes it while another thread polls it, so a
    closed fd number reused by the process is never polled in its place.
    """

    def __init__(self, pid: int, start_time: int, *, what: str = "decode process", hint: str | None = None) -> None:
        self.pid = pid
        self.start_time = start_time
        self.what = what
        pidfd: int | None
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise TransferError(f"{what} {pid} does not exist (it exited, or lives in another pid namespace)") from None
        except (AttributeError, OSError) as exc:
            if getattr(exc, "errno", errno.ENOSYS) not in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
                raise TransferError(f"cannot open {what} {pid}: {exc}") from None
            log.debug("pidfd_open is unavailable (%s); watching %s %d through /proc", exc, what, pid)
            pidfd = None
        try:
            actual = process_start_time(pid)
        except (OSError, ValueError, IndexError):
            actual = -1
        if actual != start_time:
            if pidfd is not None:
                os.close(pidfd)
            raise TransferError(
                f"pid {pid} is not the {what} that sent this address (it exited and the pid was reused, "
                "or it lives in another pid namespace)",
                hint=hint or "P and D must run in one pid namespace of one host",
            )
        self._lock = threading.Lock()
        self._pidfd = pidfd  # guarded by _lock
        self._closed = False  # guarded by _lock

    def alive(self) -> bool:
        """False once the process has exited (a zombie counts as exited) or this peer was closed."""
        with self._lock:
            if self._closed:
                return False
            if self._pidfd is not None:
                poller = select.poll()
                poller.register(self._pidfd, select.POLLIN)
                return not poller.poll(0)
            try:
                fields = _stat_fields(self.pid)
                return fields[0] not in ("Z", "X", "x") and int(fields[19]) == self.start_time
            except (OSError, ValueError, IndexError):
                return False

    def close(self) -> None:
        with self._lock:
            fd, self._pidfd, self._closed = self._pidfd, None, True
        if fd is not None:
            os.close(fd)


def ipc_session(pid: int, device: int) -> str:
    """The CUDA IPC session address of process `pid` exporting GPU `device`: it names the process like cma's does."""
    return f"ipc://{host_id()}/{pid}/{device}/{process_start_time(pid)}"


def ipc_session_process(peer: str) -> tuple[int, int] | None:
    """(pid, start time) named by a CUDA IPC session address, or None for a peer named otherwise."""
    parts = peer[len("ipc://") :].split("/") if peer.startswith("ipc://") else []
    if len(parts) != 5 or not (parts[2].isdigit() and parts[4].isdigit()):
        return None
    return int(parts[2]), int(parts[4])


class WatchedPeers:
    """Peer name -> its PeerProcess, and why writes to peers whose process exited fail.

    Not locked: its owner's lock guards it (the CUDA IPC transport's `_lock`).
    At most `max_dead` exited peers are remembered; older ones then read as unknown.
    """

    def __init__(self, what: str = "decode process", max_dead: int = 256) -> None:
        self.what = what
        self.max_dead = max_dead
        self._live: dict[str, PeerProcess] = {}
        self._dead: dict[str, str] = {}

    def watch(self, peer: str, pid: int, named: tuple[int, int] | None = None) -> None:
        """Watch process `pid` as `peer` (`named`: the pid and start time its address names, else read now).

        TransferError when the process is gone, or the address names another process.
        """
        if named is not None and named[0] != pid:
            raise TransferError(f"peer {peer} names process {named[0]} but sent the CUDA IPC handles of process {pid}")
        if named is None:
            try:
                named = (pid, process_start_time(pid))
            except (OSError, ValueError, IndexError):
                raise TransferError(f"{self.what} {pid} ({peer}) does not exist (it exited)") from None
        process = PeerProcess(pid, named[1], what=self.what)
        if not process.alive():
            process.close()
            raise TransferError(f"{self.what} {pid} ({peer}) exited", hint="D died; its request fails there")
        self.forget(peer)
        self._dead.pop(peer, None)
        self._live[peer] = process

    def exited(self, peer: str) -> str | None:
        """Why writes to `peer` fail if its process exited (it is then no longer watched), else None."""
        if peer in self._dead:
            return self._dead[peer]
        process = self._live.get(peer)
        if process is None or process.alive():
            return None
        self.forget(peer)
        while len(self._dead) >= self.max_dead:
            self._dead.pop(next(iter(self._dead)))
        self._dead[peer] = f"{self.what} {process.pid} ({peer}) exited; its CUDA IPC handles are closed"
        log.warning("ipc: %s", self._dead[peer])
        return self._dead[peer]

    def check(self, peer: str, close: Callable[[str], None]) -> None:
        """If `peer`'s process exited: `close(peer)` (its handles), then raise TransferError naming it."""
        if (why := self.exited(peer)) is not None:
            close(peer)
            raise TransferError(why, hint="D died; its request fails there")

    def sweep(self, close: Callable[[str], None]) -> None:
        """`close(peer)` for every watched peer whose process exited."""
        for peer in [p for p in list(self._live) if self.exited(p) is not None]:
            close(peer)

    def forget(self, peer: str) -> None:
        """Stop watching `peer` (its handles were closed); what is known about an exited one is kept."""
        process = self._live.pop(peer, None)
        if process is not None:
            process.close()

    def names(self) -> list[str]:
        return list(self._live)

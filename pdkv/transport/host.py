"""Which host, boot and process a peer is: what the host-local transports (cma, ipc) check a peer against.

`PeerProcess` watches a peer process of this host through a pidfd, so that a
transport writing into its memory sees its exit before the next write
(a CUDA IPC mapping of a dead process's memory still takes writes without an
error, and a recycled pid names another process).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import threading
from collections.abc import Callable, Iterator
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


def _parse_stat(stat: str) -> list[str]:
    """Fields 3.. of a /proc/<pid>/stat line (the state first)."""
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    return stat[stat.rindex(")") + 2 :].split()


def process_start_time(pid: int, proc_root: str | Path = "/proc") -> int:
    """Field 22 of /proc/<pid>/stat: when the process started, in clock ticks since boot. Raises OSError."""
    return int(_parse_stat(Path(proc_root, str(pid), "stat").read_text())[19])


PF_EXITING = 0x4  # task flag (field 9 of /proc/<pid>/stat): the process has begun to exit


class PeerProcess:
    """A process of this host that this one writes into, held open as a pidfd so its exit is seen at once.

    `start_time` (process_start_time) proves the pid still names the process
    that sent its address: a pid reused by another process is refused. With
    `exiting` a process that has begun to exit counts as gone too: a killed
    process that held a CUDA context can take seconds to finish exiting, and
    the pidfd reports it only then. That reading, and the whole check where
    the kernel has no pidfd_open (before Linux 5.3, some sandboxes), come from
    /proc/<pid>/stat, held open (its fd fails once the pid is gone, so a reused
    pid is never read in its place). Any number of threads share one peer: the
    fds are guarded by `_lock`, and `close()` never closes them while another
    thread reads them, so a closed fd number reused by the process is never read instead.
    """

    def __init__(
        self, pid: int, start_time: int, *, what: str = "decode process", hint: str | None = None, exiting: bool = False
    ) -> None:
        self.pid = pid
        self.start_time = start_time
        self.what = what
        self.exiting = exiting
        pidfd = stat_fd = None
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise TransferError(f"{what} {pid} does not exist (it exited, or lives in another pid namespace)") from None
        except (AttributeError, OSError) as exc:
            if getattr(exc, "errno", errno.ENOSYS) not in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
                raise TransferError(f"cannot open {what} {pid}: {exc}") from None
            log.debug("pidfd_open is unavailable (%s); watching %s %d through /proc", exc, what, pid)
        try:
            stat_fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            actual = int(_parse_stat(os.pread(stat_fd, 1024, 0).decode())[19])
        except (OSError, ValueError, IndexError):
            actual = -1
        self._lock = threading.Lock()
        self._pidfd = pidfd  # guarded by _lock, as is _stat_fd
        self._stat_fd = stat_fd if (exiting or pidfd is None) else None
        if stat_fd is not None and self._stat_fd is None:
            os.close(stat_fd)
        if actual != start_time:
            self.close()
            raise TransferError(
                f"pid {pid} is not the {what} that sent this address (it exited and the pid was reused, "
                "or it lives in another pid namespace)",
                hint=hint or "P and D must run in one pid namespace of one host",
            )

    def alive(self) -> bool:
        """False once the process has exited (a zombie counts as exited; with `exiting`, one that has begun
        to exit) or this peer was closed."""
        with self._lock:
            if self._pidfd is not None:
                poller = select.poll()
                poller.register(self._pidfd, select.POLLIN)
                if poller.poll(0):
                    return False
            elif self._stat_fd is None:
                return False  # closed
            if self._stat_fd is None:
                return True
            try:
                fields = _parse_stat(os.pread(self._stat_fd, 1024, 0).decode())
                flags, start = int(fields[6]), int(fields[19])
            except (OSError, ValueError, IndexError):
                return False
            return fields[0] not in ("Z", "X", "x") and not (self.exiting and flags & PF_EXITING) and start == self.start_time

    def close(self) -> None:
        with self._lock:
            fds, self._pidfd, self._stat_fd = (self._pidfd, self._stat_fd), None, None
        for fd in fds:
            if fd is not None:
                os.close(fd)


def ipc_session(pid: int, device: int) -> str:
    """The CUDA IPC session address of process `pid` exporting GPU `device`: it names the process like cma's does."""
    return f"ipc://{host_id()}/{pid}/{device}/{process_start_time(pid)}"


class WatchedPeers:
    """Peer name -> its PeerProcess, and why writes to peers whose process exited fail.

    Safe from any thread (`_lock`); the `close` callbacks run outside `_lock`. `holding` is how a write takes
    its transport's lock. At most `max_dead` exited peers are remembered; older ones then read as unknown.
    """

    def __init__(self, what: str = "decode process", max_dead: int = 256) -> None:
        self.what = what
        self.max_dead = max_dead
        self._lock = threading.RLock()
        self._live: dict[str, PeerProcess] = {}  # guarded by _lock, as is _dead
        self._dead: dict[str, str] = {}
        self._unclosed: set[str] = set()  # exited peers whose handles no one has closed yet

    def watch(self, peer: str, pid: int, start_time: int | None = None) -> None:
        """Watch process `pid` as `peer` (`start_time`: what the peer says its process's start time is, else read now).

        TransferError when the process is gone, or the pid now names another process.
        """
        if start_time is None:
            try:
                start_time = process_start_time(pid)
            except (OSError, ValueError, IndexError):
                raise TransferError(f"{self.what} {pid} ({peer}) does not exist (it exited)") from None
        process = PeerProcess(pid, start_time, what=self.what, exiting=True)
        if not process.alive():
            process.close()
            raise TransferError(f"{self.what} {pid} ({peer}) exited", hint="D died; its request fails there")
        with self._lock:
            self.forget(peer)
            self._dead.pop(peer, None)
            self._live[peer] = process

    def exited(self, peer: str) -> str | None:
        """Why writes to `peer` fail if its process exited (it is then no longer watched), else None."""
        with self._lock:
            if peer in self._dead:
                return self._dead[peer]
            process = self._live.get(peer)
            if process is None or process.alive():
                return None
            self.forget(peer)
            while len(self._dead) >= self.max_dead:
                self._dead.pop(next(iter(self._dead)))
            why = self._dead[peer] = f"{self.what} {process.pid} ({peer}) exited; its CUDA IPC handles are closed"
            self._unclosed.add(peer)
        log.warning("ipc: %s", why)
        return why

    def check(self, peer: str, close: Callable[[str], None]) -> None:
        """If `peer`'s process exited: `close(peer)` (its handles), then raise TransferError naming it."""
        if (why := self.exited(peer)) is not None:
            close(peer)
            raise TransferError(why, hint="D died; its request fails there")

    def sweep(self, close: Callable[[str], None]) -> None:
        """`close(peer)` for every watched peer whose process exited."""
        for peer in [p for p in self.names() if self.exited(p) is not None]:
            close(peer)

    def forget(self, peer: str) -> None:
        """Stop watching `peer` (its handles were closed); what is known about an exited one is kept."""
        with self._lock:
            process = self._live.pop(peer, None)
            self._unclosed.discard(peer)
        if process is not None:
            process.close()

    @contextlib.contextmanager
    def holding(self, lock: threading.RLock, peer: str, close: Callable[[str], None], poll_s: float = 0.005) -> Iterator[None]:
        """Hold `lock` (a transport's, which `close` takes too) for a write to `peer`.

        Waits for it end in TransferError as soon as `peer` is seen to have exited (checked every `poll_s`):
        lock waits are not first come, first served, and writes to other peers can hold one back for seconds.
        The holder first closes the handles of exited peers that no one has closed yet.
        """
        while not lock.acquire(timeout=poll_s):
            if (why := self.exited(peer)) is not None:
                raise TransferError(why, hint="D died; its request fails there")
        try:
            with self._lock:
                unclosed = list(self._unclosed)
            for dead in unclosed:
                close(dead)
            yield
        finally:
            lock.release()

    def names(self) -> list[str]:
        with self._lock:
            return list(self._live)

"""P's socket writes of GPU memory, run by a process of their own (`socket_send_process`).

The engine's model runner launches P's forward from Python, one layer at a time, and every call of another thread
of its process that releases the interpreter's lock (a send, a wake-up, a CUDA call) makes it wait to take the lock
back: writing beside the forward from P's own threads cost that forward 10-30 ms on an H100 (docs/bench.md). Here
P's threads only hand each write to a child process (one message out, one back) and wait: the child opens P's KV
memory through CUDA IPC as the `ipc` transport's P opens D's (pdkv.transport.ipc_share: legacy handles or VMM file
descriptors), and moves the bytes over its own connections to D, staged through pinned buffers by the GPU's copy
engines, which leave the forward's SMs alone (another process's kernels take turns with the forward's).

The child is `python -m pdkv.transport.sockets.send_main FD`, FD its end of a Unix socket pair whose other end only
this process holds: when P exits, however it exits, the child reads the end of it and exits too. It lives in P's
process group. Messages both ways are msgpack (pdkv.transport.sockets.send_wire), each behind its 4-byte length.

A child that cannot start (no CUDA, the memory cannot be opened) or dies is reported once in the log, and P's
writes then run in its own process as without it (`SendProcess.usable` false); a write the child was running when
it died fails (D recomputes that prompt). Until the child is ready (its imports and CUDA context take seconds, the
engine's own start far longer) P writes in its own process too.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from pdkv.errors import FrameError, TransferError
from pdkv.tp_heads import HeadShare
from pdkv.transport.sockets import send_wire
from pdkv.transport.sockets.streams import bound_waits
from pdkv.wire import IpcExport, Region

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # the child's imports, CUDA context and the first opening of P's memory
STOP_WAIT_S = 5.0
EXIT_WAIT_S = 2.0  # after the child's end of the socket closed, how long its exit status is waited for
# The signals on which the child's faulthandler prints its threads' stacks before it dies.
CRASHES = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT})
SEND_BOUND_S = 10.0  # a message to the child (a few KiB) waits at most this long for room in the socket


class SendProcess:
    """The child and the socket to it. `write` may be called from any thread; replies come back on a reader thread
    of this object's own, which completes each write's future."""

    def __init__(self, setup: send_wire.Setup, *, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.start_timeout_s = start_timeout_s
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        bound_waits(ours, SEND_BOUND_S, receives=False)  # a child that stops reading fails P's write, not hangs it
        self._sock = ours
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Future[tuple[int, int]]] = {}  # guarded by _lock: (bytes, descriptors) to come
        self._next = 0  # guarded by _lock
        self._ready = threading.Event()
        self._started = time.monotonic()
        self.broken = ""  # why the child cannot write (set once, before _ready is set or with it)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdkv.transport.sockets.send_main", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True,
            )
        finally:
            theirs.close()
        self._reader = threading.Thread(target=self._read, name="pdkv-send-process", daemon=True)
        self._reader.start()
        self._send(setup)

    # -- P's side --
    def share(self, export: IpcExport) -> None:
        """P's registered memory as the child opens it (`export`, whose regions are P's spans); replaces the last."""
        self._send(send_wire.Memory(export))

    @property
    def ready(self) -> bool:
        """Whether the child writes now. Until it is ready P writes in its own process, so that its start delays no
        write; one not ready within `start_timeout_s` is given up (logged)."""
        if self._ready.is_set():
            return not self.broken
        if not self.broken and time.monotonic() - self._started > self.start_timeout_s:
            self._break(f"the send process did not start within {self.start_timeout_s:g} s")
        return False

    @property
    def state(self) -> str:
        """"ready", why the child cannot write, or "starting" (for reports)."""
        return "ready" if self.ready else self.broken or "starting"

    def wait(self, timeout_s: float) -> str:
        """Wait up to `timeout_s` for the child to be ready or to fail; its `state` then."""
        self._ready.wait(timeout_s)
        return self.state

    def write(self, peer: str, transfer: str, ranges: list[tuple[int, int, int]], timeout_s: float) -> int:
        """(src, dst, length) ranges of P's memory written to `peer` under `transfer` by the child: the bytes D
        acknowledged. TransferError if the write failed there, the child died, or no answer came in time."""
        return self._call(lambda ident: send_wire.Write(ident, peer, transfer, ranges, timeout_s), timeout_s)[0]

    def write_blocks(self, peer: str, transfer: str, local_blocks: list[int], remote_blocks: list[int],
                     local_regions: list[Region], remote_regions: list[Region], heads: HeadShare | None,
                     timeout_s: float) -> tuple[int, int]:
        """Transport.write_blocks by the child, which plans the descriptors: (bytes, descriptors)."""
        return self._call(lambda ident: send_wire.WriteBlocks(
            ident, peer, transfer, local_blocks, remote_blocks, local_regions, remote_regions, heads, timeout_s), timeout_s)

    def _call(self, message: Callable[[int], send_wire.Message], timeout_s: float) -> tuple[int, int]:
        fut: Future[tuple[int, int]] = Future()
        with self._lock:
            if self.broken:
                raise TransferError(f"the send process cannot write: {self.broken}")
            self._next += 1
            ident = self._next
            self._pending[ident] = fut
        try:
            self._send(message(ident))
            # The child bounds the write itself (timeout_s); the margin covers its reply.
            return fut.result(timeout=timeout_s + 5.0)
        except FutureTimeout:
            raise TransferError(f"the send process gave no answer to a write within {timeout_s + 5.0:g} s") from None
        finally:
            with self._lock:
                self._pending.pop(ident, None)

    def close(self) -> None:
        """End the child (it reads the socket's end and exits), killed if still there after STOP_WAIT_S."""
        self._break("the socket transport is closed", quiet=True)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_WAIT_S)
        self._reader.join(STOP_WAIT_S)

    # -- internals --
    def _send(self, msg: send_wire.Message) -> None:
        data = send_wire.encode(msg)
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as exc:
            self._break(f"the send process is gone ({exc})")
            raise TransferError(f"the send process cannot write: {self.broken}") from None

    def _read(self) -> None:
        try:
            for msg in send_wire.messages(self._sock):
                if isinstance(msg, send_wire.Ready):
                    self._ready.set()
                elif isinstance(msg, send_wire.Broken):
                    self._break(msg.why)
                elif isinstance(msg, send_wire.Done):
                    self._settle(msg.ident, (msg.landed, msg.descriptors), None)
                elif isinstance(msg, send_wire.Failed):
                    self._settle(msg.ident, (0, 0), TransferError(msg.why, hint=msg.hint or None))
        except FrameError as exc:
            self._break(f"the send process said something malformed: {exc}")
        except OSError as exc:  # a reset: the child ended with P's messages unread
            self._break(self._how_it_ended(f"the send process's socket failed: {exc}"))
        else:
            self._break(self._how_it_ended("the send process closed its socket"))

    def _how_it_ended(self, otherwise: str) -> str:
        """The child's end in words once its socket ended: its exit status, or the signal that killed it (its
        threads' stacks are then on P's stderr, by faulthandler); `otherwise` if it has not exited."""
        try:
            code = self.proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return otherwise
        if code < 0:
            try:
                sig = signal.Signals(-code)
            except ValueError:
                return f"the send process was killed by signal {-code}"
            stacks = " (its threads' stacks: this process's stderr)" if sig in CRASHES else ""
            return f"the send process was killed by {sig.name}{stacks}"
        return f"the send process exited with status {code}"

    def _settle(self, ident: int, result: tuple[int, int], error: TransferError | None) -> None:
        with self._lock:
            fut = self._pending.get(ident)
        if fut is None or fut.done():
            return
        fut.set_exception(error) if error is not None else fut.set_result(result)

    def _break(self, why: str, *, quiet: bool = False) -> None:
        with self._lock:
            first = not self.broken
            if first:
                self.broken = why
            pending, self._pending = list(self._pending.values()), {}
        self._ready.set()  # settled: `ready` is false from now on
        for fut in pending:
            if not fut.done():
                fut.set_exception(TransferError(f"the send process cannot write: {why}"))
        if first and not quiet:
            log.warning("pdkv: %s; P writes in its own process from now on", why)


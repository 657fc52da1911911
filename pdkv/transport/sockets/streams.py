"""Moving a write's bytes between host memory and a socket, straight through memoryviews (GPU memory: staging.py).

P sends memoryviews of its KV (sendmsg, no copy in Python) and D receives into memoryviews of its KV
(recvmsg_into), up to IOV_MAX ranges a call: the kernel's copies are the only ones. The sockets block, each wait
bounded by the kernel (`bound_waits`), so one call moves all the bytes it was given rather than one socket buffer's
worth.
"""

from __future__ import annotations

import bisect
import ctypes
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from pdkv.errors import TransferError

IOV_MAX = 1024  # buffers one sendmsg takes at most (Linux's UIO_MAXIOV)
# What a send or receive call raises when its bound passed with no byte moved: TimeoutError on a socket with a Python
# timeout, BlockingIOError (EAGAIN) on one bounded by the kernel (bound_waits).
WAIT_EXPIRED = (TimeoutError, BlockingIOError)


def bound_waits(sock: socket.socket, seconds: float, *, receives: bool = True) -> None:
    """Make `sock` block, each send or receive call on it waiting at most `seconds` (SO_SNDTIMEO, SO_RCVTIMEO).

    Why not `settimeout`: a socket with a Python timeout is non-blocking underneath, so every call returns once one
    socket buffer's worth has moved and a poll() comes before the next: hundreds of calls, each taking the GIL, for
    one write. A blocking call moves everything it was given (MSG_WAITALL on receive), sleeping in the kernel. A call
    that reaches its bound returns what it moved; one that moved nothing raises BlockingIOError (see WAIT_EXPIRED).
    A shutdown() from another thread wakes it at once. `receives=False` bounds the sends alone (a socket whose
    reader waits, unbounded, for whatever comes next).
    """
    if sock.gettimeout() is not None:
        sock.settimeout(None)
    micros = max(1, round(seconds * 1_000_000))  # a zero timeval would mean no bound at all
    tv = struct.pack("@ll", *divmod(micros, 1_000_000))  # struct timeval
    if receives:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def host_view(addr: int, length: int) -> memoryview:
    """A writable memoryview of `length` bytes at `addr` in this process (registered memory only: callers check)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; TransferError when the peer closes first. The socket's timeout bounds each wait."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise TransferError(f"the connection closed after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def _advance(pending: list[memoryview], i: int, done: int) -> int:
    """Mark `done` more bytes of `pending` from view `i` on as moved: the index of the first view not yet whole (a
    view moved in part is replaced by its rest)."""
    while done and i < len(pending):
        n = len(pending[i])
        if done >= n:
            done -= n
            i += 1
        else:
            pending[i] = pending[i][done:]
            done = 0
    return i


def send_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Send every view in order with as few system calls as the kernel allows (sendmsg of up to IOV_MAX buffers)."""
    pending = [v for v in views if len(v)]
    i = 0
    while i < len(pending):
        i = _advance(pending, i, sock.sendmsg(pending[i : i + IOV_MAX]))


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view in order with as few system calls as the kernel allows (recvmsg_into up to IOV_MAX buffers):
    many small ranges (scattered blocks) land with one call rather than one each. TransferError when the peer
    closes first; the socket's timeout bounds each wait."""
    pending = [v for v in views if len(v)]
    total, i = sum(len(v) for v in pending), 0
    got = 0
    while i < len(pending):
        k = sock.recvmsg_into(pending[i : i + IOV_MAX], 0, socket.MSG_WAITALL)[0]
        if k == 0:
            raise TransferError(f"the connection closed after {got} of {total} bytes")
        got += k
        i = _advance(pending, i, k)


class HostSpans:
    """This process's registered host memory as memoryviews, one per merged span: a range inside it becomes a view by
    slicing, with no ctypes object per range. Immutable: the transport replaces it whole when its registration
    changes."""

    def __init__(self, spans: Sequence[tuple[int, int]]) -> None:
        """`spans`: merged (address, length) spans, sorted."""
        self._starts = [a for a, _ in spans]
        self._views = [host_view(a, n) for a, n in spans]

    def views(self, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """A view of each (address, length); TransferError for a range not inside one registered span (memory
        unregistered since it was checked)."""
        out: list[memoryview] = []
        starts, views, find = self._starts, self._views, bisect.bisect_right
        for addr, length in ranges:
            i = find(starts, addr) - 1
            off = addr - starts[i] if i >= 0 else -1
            view = views[i][off : off + length] if off >= 0 else None
            if view is None or len(view) != length:  # a slice past a span's end comes back short
                raise TransferError(f"{addr:#x}+{length} is not inside this process's registered memory")
            out.append(view)
        return out


class HostMemory:
    """Ranges of this process's host memory, sent and received in place. `spans()`: the registered memory now."""

    def __init__(self, spans: Callable[[], HostSpans]) -> None:
        self._spans = spans

    def send(self, sock: socket.socket, ranges: Sequence[tuple[int, int]], head: bytes = b"") -> None:
        """`head` (a frame), then the bytes of `ranges`, in as few calls as the kernel allows."""
        views = self._spans().views(ranges)
        send_views(sock, [memoryview(head), *views] if head else views)

    def receive(self, sock: socket.socket, ranges: Sequence[tuple[int, int]]) -> None:
        recv_views(sock, self._spans().views(ranges))

    def close(self) -> None:
        pass


def read_frame(sock: socket.socket, expect: Sequence[Any]) -> tuple[Any, bytes]:
    """One frame (kind, body) of a kind in `expect`; FrameError for a malformed head, TransferError when the peer
    closes. The socket's timeout bounds each wait."""
    from pdkv.transport.sockets.wire import HEAD, read_head

    kind, length = read_head(recv_exact(sock, HEAD.size), expect)
    return kind, recv_exact(sock, length) if length else b""

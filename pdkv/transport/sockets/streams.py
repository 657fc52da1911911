"""Moving a write's bytes between memory and a socket: host memory straight through memoryviews, GPU memory through
pinned host buffers of the transport's own, double-buffered on a CUDA stream of its own.

Host memory: P sends memoryviews of its KV (sendmsg, no copy in Python) and D receives into memoryviews of its KV
(recvmsg_into), up to IOV_MAX ranges a call: the kernel's copies are the only ones. GPU memory: each range is cut
into chunks of `chunk_bytes`; P copies chunk k+1 out of the GPU while chunk k is on the wire, D copies chunk k into
the GPU while chunk k+1 arrives.
torch is imported only when a transport stages GPU memory.
"""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Sequence
from typing import Any

from pdkv.errors import TransferError

IOV_MAX = 1024  # buffers one sendmsg takes at most (Linux's UIO_MAXIOV)
DEFAULT_CHUNK_BYTES = 8 << 20  # one staging buffer; two per connection and side


def host_view(addr: int, length: int) -> memoryview:
    """A writable memoryview of `length` bytes at `addr` in this process (registered memory only: callers check)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; TransferError when the peer closes first. The socket's timeout bounds each wait."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
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
        k = sock.recvmsg_into(pending[i : i + IOV_MAX])[0]
        if k == 0:
            raise TransferError(f"the connection closed after {got} of {total} bytes")
        got += k
        i = _advance(pending, i, k)


def chunked(ranges: Sequence[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    """`ranges` cut into pieces of at most `chunk` bytes, in order."""
    out: list[tuple[int, int]] = []
    for addr, length in ranges:
        for off in range(0, length, chunk):
            out.append((addr + off, min(chunk, length - off)))
    return out


class HostMemory:
    """Ranges of this process's host memory, sent and received in place."""

    def send(self, sock: socket.socket, ranges: Sequence[tuple[int, int]]) -> None:
        send_views(sock, [host_view(a, n) for a, n in ranges])

    def receive(self, sock: socket.socket, ranges: Sequence[tuple[int, int]]) -> None:
        recv_views(sock, [host_view(a, n) for a, n in ranges])

    def close(self) -> None:
        pass


class _CudaSpan:
    """`length` bytes of GPU memory at `addr`, for torch.as_tensor (the CUDA array interface, no copy)."""

    def __init__(self, addr: int, length: int) -> None:
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (addr, False), "version": 3}


class CudaStaging:
    """Ranges of GPU memory, sent and received through two pinned host buffers on a stream of the staging's own.

    One per connection (the buffers are the connection's): not shared between threads.
    """

    def __init__(self, device: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.chunk = chunk_bytes
        torch.cuda.set_device(device)
        self._stream = torch.cuda.Stream(device=device)
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._views = [host_view(int(b.data_ptr()), chunk_bytes) for b in self._buffers]
        self._events = [torch.cuda.Event() for _ in range(2)]

    def _span(self, addr: int, length: int) -> Any:
        return self._torch.as_tensor(_CudaSpan(addr, length), device=f"cuda:{self.device}")

    def _copy(self, i: int, dst: Any, src: Any) -> None:
        with self._torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            self._events[i % 2].record(self._stream)

    def send(self, sock: socket.socket, ranges: Sequence[tuple[int, int]]) -> None:
        """Copy chunk k+1 out of the GPU while chunk k goes out on `sock`."""
        pieces = chunked(ranges, self.chunk)
        for i in range(min(2, len(pieces))):
            self._copy_out(i, pieces[i])
        for i, (_, n) in enumerate(pieces):
            self._events[i % 2].synchronize()
            sock.sendall(self._views[i % 2][:n])
            if i + 2 < len(pieces):
                self._copy_out(i + 2, pieces[i + 2])

    def _copy_out(self, i: int, piece: tuple[int, int]) -> None:
        addr, n = piece
        self._copy(i, self._buffers[i % 2][:n], self._span(addr, n))

    def receive(self, sock: socket.socket, ranges: Sequence[tuple[int, int]]) -> None:
        """Copy chunk k into the GPU while chunk k+1 arrives on `sock`; return once every byte is in GPU memory."""
        try:
            for i, (addr, n) in enumerate(chunked(ranges, self.chunk)):
                if i >= 2:
                    self._events[i % 2].synchronize()  # the buffer's last copy into the GPU is done
                recv_exact_into(sock, self._views[i % 2][:n])
                self._copy(i, self._span(addr, n), self._buffers[i % 2][:n])
        finally:
            self._stream.synchronize()

    def close(self) -> None:
        self._stream.synchronize()
        self._buffers.clear()
        self._views.clear()


def read_frame(sock: socket.socket, expect: Sequence[Any]) -> tuple[Any, bytes]:
    """One frame (kind, body) of a kind in `expect`; FrameError for a malformed head, TransferError when the peer
    closes. The socket's timeout bounds each wait."""
    from pdkv.transport.sockets.wire import HEAD, read_head

    kind, length = read_head(recv_exact(sock, HEAD.size), expect)
    return kind, recv_exact(sock, length) if length else b""

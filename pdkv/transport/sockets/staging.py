"""GPU memory on the socket transport: staged through pinned host buffers of the connection's own, double-buffered
on a CUDA stream of its own.

A write's ranges are packed, in order, into batches of at most `chunk_bytes` (`packed`): many small ranges (KV
blocks scattered over the cache, 64 KiB each) share one batch, and a long range runs on into the next. P gathers
batch k+1 out of the GPU while batch k is on the wire; D receives batch k+1 while batch k is scattered into the GPU.
A batch of several ranges is gathered (or scattered) by one kernel launch into (out of) a device buffer, which one
copy moves to (from) the pinned buffer; a batch of one range is copied straight. The bytes on the wire are the
ranges' bytes in order either way, so P's and D's batches need not line up.
torch (and, for batches of several ranges, Triton) is imported only when a transport stages GPU memory.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from pdkv.transport.sockets.streams import host_view, recv_exact_into

DEFAULT_CHUNK_BYTES = 8 << 20  # one staging buffer; two per connection and side
ROW_BYTES = 64 << 10  # the most one kernel program copies: a batch's ranges are cut into rows of at most this
ALIGN = 16  # the copy kernel's loads and stores are 16-byte vectors

Batch = list[tuple[int, int, int]]  # (address, offset in the batch, length)


def packed(ranges: Sequence[tuple[int, int]], chunk: int) -> list[Batch]:
    """`ranges` in order, packed into batches of at most `chunk` bytes; a range longer than what is left of a batch
    goes on in the next one."""
    batches: list[Batch] = []
    batch: Batch = []
    used = 0
    for addr, length in ranges:
        while length > 0:
            n = min(length, chunk - used)
            batch.append((addr, used, n))
            addr, length, used = addr + n, length - n, used + n
            if used == chunk:
                batches.append(batch)
                batch, used = [], 0
    if batch:
        batches.append(batch)
    return batches


def batch_bytes(batch: Batch) -> int:
    _, off, n = batch[-1]
    return off + n


def copy_rows(batch: Batch, buffer: int, *, gather: bool, row: int = ROW_BYTES) -> list[tuple[int, int, int]]:
    """The copy kernel's (source, destination, bytes) rows for one batch against a buffer at address `buffer`:
    ranges into the buffer (`gather`, P) or out of it (D), each cut into rows of at most `row` bytes."""
    rows = []
    for addr, off, n in batch:
        for k in range(0, n, row):
            ext, buf, m = addr + k, buffer + off + k, min(row, n - k)
            rows.append((ext, buf, m) if gather else (buf, ext, m))
    return rows


def kernel_fits(batch: Batch) -> bool:
    """Whether the copy kernel may move `batch`: every address, offset and length 16-byte aligned."""
    return all(addr % ALIGN == 0 and off % ALIGN == 0 and n % ALIGN == 0 for addr, off, n in batch)


class _CudaSpan:
    """`length` bytes of GPU memory at `addr`, for torch.as_tensor (the CUDA array interface, no copy)."""

    def __init__(self, addr: int, length: int) -> None:
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (addr, False), "version": 3}


class CudaStaging:
    """Ranges of GPU memory, sent and received through two pinned host buffers (and two device buffers for batches
    of several ranges) on a stream of the staging's own.

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
        self._device_buffers: list[Any] = []  # made on the first batch of several ranges
        self._events = [torch.cuda.Event() for _ in range(2)]
        self._kernel: Any = None
        self._tables: tuple[Any, Any] | None = None  # (pinned, device) int64 rows of 3, grown by doubling

    def _span(self, addr: int, length: int) -> Any:
        return self._torch.as_tensor(_CudaSpan(addr, length), device=f"cuda:{self.device}")

    def _device_buffer(self, i: int) -> Any:
        if not self._device_buffers:
            self._device_buffers = [self._torch.empty(self.chunk, dtype=self._torch.uint8, device=f"cuda:{self.device}") for _ in range(2)]
        return self._device_buffers[i % 2]

    def _table(self, rows: int) -> tuple[Any, Any]:
        """A pinned and a device table of at least `rows` rows, kept for the next transfer."""
        if self._tables is None or self._tables[0].shape[0] < rows:
            size = max(rows, 2 * self._tables[0].shape[0] if self._tables else 1024)
            torch = self._torch
            self._tables = (
                torch.empty((size, 3), dtype=torch.int64, pin_memory=True),
                torch.empty((size, 3), dtype=torch.int64, device=f"cuda:{self.device}"),
            )
        return self._tables

    def _plan(self, batches: list[Batch], *, gather: bool) -> list[Any]:
        """Each batch's rows for the copy kernel (None: a batch of one range, or one the kernel's alignment does not
        fit), all in one device table that one asynchronous copy from pinned memory fills, queued on the stream before
        the first batch's work. A table built per launch from host memory would wait for the stream each time: on D,
        for the batch just received to reach the GPU before the next is read off the socket."""
        rows = [
            copy_rows(b, int(self._device_buffer(i).data_ptr()), gather=gather) if len(b) > 1 and kernel_fits(b) else []
            for i, b in enumerate(batches)
        ]
        total = sum(len(r) for r in rows)
        if not total:
            return [None] * len(batches)
        pinned, device = self._table(total)
        pinned[:total].copy_(self._torch.tensor([(s, d, n // 8) for r in rows for s, d, n in r], dtype=self._torch.int64))
        with self._torch.cuda.stream(self._stream):
            device[:total].copy_(pinned[:total], non_blocking=True)
        tables, start = [], 0
        for r in rows:
            tables.append(device[start : start + len(r)] if r else None)
            start += len(r)
        return tables

    def _launch(self, table: Any) -> None:
        """One launch of the copy kernel over `table`'s rows, on the staging's stream (the caller's context)."""
        if self._kernel is None:
            from pdkv.transport.cuda_kernels import copy_kernels

            self._kernel = copy_kernels()["chunks"]
        self._kernel[(table.shape[0],)](table, 3, CHUNK_WORDS=ROW_BYTES // 8, BLOCK=1024, num_warps=4)

    def _gather(self, i: int, batch: Batch, table: Any) -> None:
        """Batch `i`'s ranges into pinned buffer i % 2, on the stream; its event marks the buffer full."""
        total, host = batch_bytes(batch), self._buffers[i % 2]
        with self._torch.cuda.stream(self._stream):
            if len(batch) == 1:
                addr, _, n = batch[0]
                host[:n].copy_(self._span(addr, n), non_blocking=True)
            else:
                dev = self._device_buffer(i)
                self._move(batch, dev, table, gather=True)
                host[:total].copy_(dev[:total], non_blocking=True)
            self._events[i % 2].record(self._stream)

    def _scatter(self, i: int, batch: Batch, table: Any) -> None:
        """Pinned buffer i % 2 (batch `i`, received) into its ranges, on the stream; its event marks the buffer free."""
        total, host = batch_bytes(batch), self._buffers[i % 2]
        with self._torch.cuda.stream(self._stream):
            if len(batch) == 1:
                addr, _, n = batch[0]
                self._span(addr, n).copy_(host[:n], non_blocking=True)
            else:
                dev = self._device_buffer(i)
                dev[:total].copy_(host[:total], non_blocking=True)
                self._move(batch, dev, table, gather=False)
            self._events[i % 2].record(self._stream)

    def _move(self, batch: Batch, dev: Any, table: Any, *, gather: bool) -> None:
        """Between the batch's ranges and device buffer `dev`: one kernel launch over the batch's `table`, or (no table:
        the kernel's alignment does not hold) a copy a range."""
        if table is not None:
            self._launch(table)
            return
        for addr, off, n in batch:
            ext = self._span(addr, n)
            if gather:
                dev[off : off + n].copy_(ext, non_blocking=True)
            else:
                ext.copy_(dev[off : off + n], non_blocking=True)

    def send(self, sock: socket.socket, ranges: Sequence[tuple[int, int]], head: bytes = b"") -> None:
        """`head` (a frame), then the ranges: batch k+1 is gathered out of the GPU while batch k goes out on `sock`."""
        batches = packed(ranges, self.chunk)
        try:
            tables = self._plan(batches, gather=True)
            for i in range(min(2, len(batches))):
                self._gather(i, batches[i], tables[i])
            if head:
                sock.sendall(head)
            for i, batch in enumerate(batches):
                self._events[i % 2].synchronize()
                sock.sendall(self._views[i % 2][: batch_bytes(batch)])
                if i + 2 < len(batches):
                    self._gather(i + 2, batches[i + 2], tables[i + 2])
        finally:
            self._stream.synchronize()  # the tables and buffers are free for the next transfer

    def receive(self, sock: socket.socket, ranges: Sequence[tuple[int, int]]) -> None:
        """Scatter batch k into the GPU while batch k+1 arrives on `sock`; return once every byte is in GPU memory."""
        batches = packed(ranges, self.chunk)
        try:
            tables = self._plan(batches, gather=False)
            for i, batch in enumerate(batches):
                if i >= 2:
                    self._events[i % 2].synchronize()  # the buffer's last batch is in the GPU
                recv_exact_into(sock, self._views[i % 2][: batch_bytes(batch)])
                self._scatter(i, batch, tables[i])
        finally:
            self._stream.synchronize()

    def close(self) -> None:
        self._stream.synchronize()
        self._buffers.clear()
        self._views.clear()
        self._device_buffers.clear()
        self._tables = None

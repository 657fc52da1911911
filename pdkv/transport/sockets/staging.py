"""GPU memory on the socket transport: staged through pinned host buffers of the connection's own, double-buffered
on a CUDA stream of its own.

A write's ranges are packed, in order, into batches of at most `chunk_bytes` and MAX_ROWS kernel rows (`packed`):
many small ranges (KV blocks scattered over the cache, 64 KiB each) share one batch, and a long range runs on into
the next. P gathers batch k+1 out of the GPU while batch k is on the wire; D receives batch k+1 while batch k is
scattered into the GPU. The bytes on the wire are the ranges' bytes in order, so P's and D's batches need not line up.

A batch moves one of two ways (ENGINES). "copies": one cuMemcpyAsync a range, queued without releasing the
interpreter's lock, on the GPU's copy engines, which leave its SMs to the forward of every other process on the GPU
(D's, and P's send process's, default). "kernel": one replay of a CUDA graph captured once per buffer: the batch's
rows (`copy_rows`, written into a pinned table) are uploaded, then the copy kernel moves every row straight between
GPU memory and the pinned buffer, which the GPU reaches by its mapping of pinned host memory (P's own threads'
default). Why a graph there, and not a Triton launch and a copy a batch: those threads share the interpreter's lock
with the engine's model runner, and every call that releases it (each torch call, each launch) lets the model
runner's thread wait to take it back; writing beside P's forward (`socket_write_layers`) those waits are what the
forward loses (docs/socket.md). A batch costs its thread four such calls (replay, event, wait, send).
torch, numpy and Triton are imported only when a transport stages GPU memory.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from pdkv.transport.sockets.streams import host_view, recv_exact_into, send_views

DEFAULT_CHUNK_BYTES = 8 << 20  # one staging buffer; two per connection and side
ROW_BYTES = 64 << 10  # the most one kernel program copies: a batch's ranges are cut into rows of at most this
MAX_ROWS = 2048  # rows of one batch: the captured launch's grid (rows past a batch's own copy nothing)
ALIGN = 16  # the copy kernel's loads and stores are 16-byte vectors

Batch = list[tuple[int, int, int]]  # (address, offset in the batch, length)


def packed(ranges: Sequence[tuple[int, int]], chunk: int, max_rows: int = MAX_ROWS, row: int = ROW_BYTES) -> list[Batch]:
    """`ranges` in order, packed into batches of at most `chunk` bytes and `max_rows` rows of at most `row` bytes; a
    range longer than what is left of a batch goes on in the next one."""
    batches: list[Batch] = []
    batch: Batch = []
    used = rows = 0
    for addr, length in ranges:
        while length > 0:
            n = min(length, chunk - used, (max_rows - rows) * row)
            batch.append((addr, used, n))
            addr, length, used, rows = addr + n, length - n, used + n, rows + -(-n // row)
            if used == chunk or rows == max_rows:
                batches.append(batch)
                batch, used, rows = [], 0, 0
    if batch:
        batches.append(batch)
    return batches


def batch_bytes(batch: Batch) -> int:
    _, off, n = batch[-1]
    return off + n


def copy_rows(batch: Batch, buffer: int, *, gather: bool, row: int = ROW_BYTES) -> Any:
    """The copy kernel's rows for one batch against a buffer at address `buffer`: an int64 array of (source,
    destination, bytes), ranges into the buffer (`gather`, P) or out of it (D), each cut into rows of at most
    `row` bytes."""
    import numpy as np

    b = np.asarray(batch, dtype=np.int64).reshape(-1, 3)
    counts = -(-b[:, 2] // row)
    at = np.repeat(np.arange(len(b)), counts)
    skip = (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)) * row
    ext, buf, n = b[at, 0] + skip, buffer + b[at, 1] + skip, np.minimum(row, b[at, 2] - skip)
    return np.stack([ext, buf, n] if gather else [buf, ext, n], axis=1)


def kernel_fits(batch: Batch) -> bool:
    """Whether the copy kernel may move `batch`: every address, offset and length 16-byte aligned."""
    return all(addr % ALIGN == 0 and off % ALIGN == 0 and n % ALIGN == 0 for addr, off, n in batch)


class _BatchGraph:
    """One staging buffer's captured launch: upload the rows table from pinned memory, then the copy kernel over
    MAX_ROWS rows. `table` (the pinned rows, numpy) is written before each replay; rows past the batch's have length
    0. The device table lives as long as the graph, which holds no tensor of its own."""

    def __init__(self, torch: Any, kernel: Any, device: int, stream: Any) -> None:
        self.host = torch.zeros((MAX_ROWS, 3), dtype=torch.int64).pin_memory()
        self.table = self.host.numpy()
        self.device = torch.zeros((MAX_ROWS, 3), dtype=torch.int64, device=f"cuda:{device}")
        self.used = 0
        meta = {"CHUNK_WORDS": ROW_BYTES // 8, "BLOCK": 1024, "num_warps": 4}
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            kernel[(MAX_ROWS,)](self.device, 3, **meta)  # compiles and loads it outside the capture; every row empty
            # capture_begin rather than torch.cuda.graph, which synchronizes the device (the engine's forward) and
            # empties its cache; thread_local: the engine's threads go on launching meanwhile.
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.device.copy_(self.host, non_blocking=True)
                kernel[(MAX_ROWS,)](self.device, 3, **meta)
            finally:
                self.graph.capture_end()

    def fill(self, rows: Any) -> None:
        """The batch's (source, destination, bytes) rows; the kernel counts 8-byte words."""
        k = len(rows)
        self.table[:k, :2] = rows[:, :2]
        self.table[:k, 2] = rows[:, 2] // 8
        if self.used > k:
            self.table[k : self.used, 2] = 0
        self.used = k


ENGINES = ("kernel", "copies")


class CudaStaging:
    """Ranges of GPU memory, sent and received through two pinned host buffers on a stream of the staging's own.

    One per connection (the buffers are the connection's), made and used by that connection's thread. `engine`:
    "kernel" moves a batch by one replay of the copy kernel's graph (the GPU's SMs read and write host memory);
    "copies" queues one copy a range on the GPU's copy engines (cuMemcpyAsync, a few microseconds each, the
    interpreter's lock held), which leave the SMs to the engine's forward: another process's kernels on the same
    GPU take turns with the forward's, its copies do not (docs/socket.md).
    """

    def __init__(self, device: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, engine: str = "kernel") -> None:
        import torch

        from pdkv.transport.cuda_kernels import FIRST_LAUNCH, CudaDriver, copy_kernels

        self._torch = torch
        self.device = device
        self.chunk = chunk_bytes
        torch.cuda.set_device(device)
        self._stream = torch.cuda.Stream(device=device)
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._views = [host_view(int(b.data_ptr()), chunk_bytes) for b in self._buffers]
        self._driver = driver = CudaDriver()
        self._mapped = [driver.host_device_pointer(int(b.data_ptr())) for b in self._buffers]  # as the GPU sees them
        self._events = [torch.cuda.Event() for _ in range(2)]
        self.engine = engine
        self._copy = driver.async_copy()
        with FIRST_LAUNCH:  # each connection's thread makes its staging at its first write, all at once
            self._graphs = ([_BatchGraph(torch, copy_kernels()["chunks"], device, self._stream) for _ in range(2)]
                            if engine == "kernel" else [])

    def _stage(self, i: int, batch: Batch, *, gather: bool) -> None:
        """Batch `i` between its ranges and pinned buffer i % 2 (into it: `gather`, P; out of it: D), on the stream;
        the buffer's event marks it done. The buffer's previous batch must be done (its event waited for)."""
        torch = self._torch
        with torch.cuda.stream(self._stream):
            if self._graphs and kernel_fits(batch):
                graph = self._graphs[i % 2]
                graph.fill(copy_rows(batch, self._mapped[i % 2], gather=gather))
                graph.graph.replay()
            else:  # the copy engines (or not 16-byte aligned): a copy a range
                host, copy, stream = self._mapped[i % 2], self._copy, self._stream.cuda_stream
                for addr, off, n in batch:
                    if rc := (copy(host + off, addr, n, stream) if gather else copy(addr, host + off, n, stream)):
                        self._driver.check(rc, "cuMemcpyAsync")
            self._events[i % 2].record(self._stream)

    def send(self, sock: socket.socket, ranges: Sequence[tuple[int, int]], head: bytes = b"") -> None:
        """`head` (a frame), then the ranges: batch k+1 is gathered out of the GPU while batch k goes out on `sock`."""
        batches = packed(ranges, self.chunk)
        try:
            for i in range(min(2, len(batches))):
                self._stage(i, batches[i], gather=True)
            for i, batch in enumerate(batches):
                self._events[i % 2].synchronize()
                view = self._views[i % 2][: batch_bytes(batch)]
                send_views(sock, [memoryview(head), view] if head and i == 0 else [view])
                if i + 2 < len(batches):
                    self._stage(i + 2, batches[i + 2], gather=True)
            if not batches and head:
                sock.sendall(head)
        except BaseException:
            self._stream.synchronize()  # the buffers and tables are free for the next transfer
            raise

    def receive(self, sock: socket.socket, ranges: Sequence[tuple[int, int]]) -> None:
        """Scatter batch k into the GPU while batch k+1 arrives on `sock`; return once every byte is in GPU memory."""
        batches = packed(ranges, self.chunk)
        try:
            for i, batch in enumerate(batches):
                if i >= 2:
                    self._events[i % 2].synchronize()  # the buffer's last batch is in the GPU
                recv_exact_into(sock, self._views[i % 2][: batch_bytes(batch)])
                self._stage(i, batch, gather=False)
        finally:
            self._stream.synchronize()

    def close(self) -> None:
        self._stream.synchronize()
        self._graphs.clear()
        self._buffers.clear()
        self._views.clear()

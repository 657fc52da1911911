"""The send process itself: `python -m pdkv.transport.sockets.send_main FD` (started by
pdkv.transport.sockets.send_process, FD its end of the socket pair to P).

It reads a Setup, starts CUDA on P's GPU and a socket transport of its own (P's settings, the copy engines' staging
by default), answers Ready (or Broken, and exits); then opens P's memory as each Memory names it and runs each Write
on a thread of its own, answering Done or Failed. The end of the socket (P closed it or exited) ends the process at
once, writes in flight or not: it holds no state P or D depend on.
"""

from __future__ import annotations

import bisect
import faulthandler
import functools
import os
import socket
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdkv.errors import FrameError, PdkvError, TransferError
from pdkv.transport.base import Descriptor
from pdkv.transport.sockets import send_wire
from pdkv.transport.sockets.transport import SocketTransport
from pdkv.wire import IpcExport, Region

MAX_WRITES = 32  # writes run at once (P's writer threads: a few per D)


class Translation:
    """P's registered spans and where each lies in this process: `here(addr, n)` for a range inside one span."""

    def __init__(self, spans: list[tuple[int, int, int]]) -> None:
        self.spans = sorted(spans)  # (P's start, P's end, address here of P's start)
        self._starts = [s for s, _, _ in self.spans]

    def here(self, addr: int, length: int) -> int:
        at = bisect.bisect_right(self._starts, addr) - 1
        if at < 0 or addr + length > self.spans[at][1]:
            raise TransferError(f"P's range 0x{addr:x}+{length} lies outside the memory the send process opened")
        start, _, local = self.spans[at]
        return local + addr - start


class Child:
    """The send process's work: `transport` (a SocketTransport of its own, P's settings) writes; `opener(export)`
    opens P's memory and gives each of its regions as (P's start, P's end, address here)."""

    def __init__(self, sock: socket.socket, transport: SocketTransport, opener: Callable[[IpcExport], list[tuple[int, int, int]]]) -> None:
        self.sock = sock
        self.transport = transport
        self.opener = opener
        self._send_lock = threading.Lock()
        self.translation = Translation([])
        self.pool = ThreadPoolExecutor(max_workers=MAX_WRITES, thread_name_prefix="pdkv-send-write")

    def reply(self, msg: send_wire.Message) -> None:
        with self._send_lock:
            self.sock.sendall(send_wire.encode(msg))

    def open(self, msg: send_wire.Memory) -> None:
        spans = self.opener(msg.export)
        self.transport.unregister([(here, end - start) for start, end, here in self.translation.spans])
        self.transport.register([(here, end - start) for start, end, here in spans])
        self.translation = Translation(spans)

    def write(self, msg: send_wire.Write) -> tuple[int, int]:
        """A Write: its ranges mapped here and written; (bytes, descriptors)."""
        here = self.translation.here
        descriptors = [Descriptor(here(src, n), dst, n) for src, dst, n in msg.ranges]
        self.transport.write(msg.peer, descriptors, transfer=msg.transfer, timeout_s=msg.timeout_s)
        return sum(n for _, _, n in msg.ranges), len(descriptors)

    def write_blocks(self, msg: send_wire.WriteBlocks) -> tuple[int, int]:
        """A WriteBlocks: P's regions mapped here, the descriptors planned here; (bytes, descriptors)."""
        here = self.translation.here
        local = [Region(here(r.base, r.block_len * r.num_blocks), r.block_len, r.num_blocks) for r in msg.local_regions]
        out = self.transport.write_blocks(msg.peer, msg.local_blocks, msg.remote_blocks, local, msg.remote_regions, msg.heads,
                                          transfer=msg.transfer)
        return out.bytes, out.descriptors

    def answer(self, ident: int, work: Callable[[], tuple[int, int]]) -> None:
        """Run one write (on a pool thread) and answer P: Done, or Failed with the reason P's write raises."""
        try:
            landed, descriptors = work()
            self.reply(send_wire.Done(ident, landed, descriptors))
        except PdkvError as exc:
            self._fail(ident, exc.message, exc.hint or "")
        except Exception as exc:  # reported to P's write, which fails that transfer
            self._fail(ident, f"the send process's write failed: {exc}", "")

    def _fail(self, ident: int, why: str, hint: str) -> None:
        try:
            self.reply(send_wire.Failed(ident, why, hint))
        except OSError:
            pass  # P is gone: the loop ends the process

    def serve(self, messages: Any) -> None:
        for msg in messages:
            if isinstance(msg, send_wire.WriteBlocks):
                self.pool.submit(self.answer, msg.ident, functools.partial(self.write_blocks, msg))
            elif isinstance(msg, send_wire.Write):
                self.pool.submit(self.answer, msg.ident, functools.partial(self.write, msg))
            elif isinstance(msg, send_wire.Memory):
                self.open(msg)


def cuda_child(sock: socket.socket, setup: send_wire.Setup) -> Child:
    """The child on P's GPU: a CUDA context, a socket transport staging GPU memory, P's memory opened through CUDA
    IPC (each opening kept: the process's end releases them)."""
    import torch  # an optional dependency: the child exists only where P's KV is on a GPU

    from pdkv.transport.cuda_kernels import CudaDriver
    from pdkv.transport.ipc_share import open_export

    torch.cuda.set_device(setup.device)
    torch.zeros(1, device=f"cuda:{setup.device}")  # the context, before the first write needs it
    driver = CudaDriver()
    transport = SocketTransport(
        writable=False, gpu=setup.device, connections=setup.connections, write_timeout_s=setup.write_timeout_s,
        token=setup.token, chunk_bytes=setup.chunk_bytes, buffer_bytes=setup.buffer_bytes, staging=setup.staging,
    )
    opened: list[Any] = []

    def opener(export: IpcExport) -> list[tuple[int, int, int]]:
        opened.append(peer := open_export(driver, export, setup.device))
        return [peer.span(export, region) for region in export.regions]

    return Child(sock, transport, opener)


def main(argv: list[str]) -> int:
    faulthandler.enable()  # a crash (CUDA, the driver's mappings) prints every thread's stack to P's log, then ends
    sock = socket.socket(fileno=int(argv[1]))
    messages = send_wire.messages(sock)
    try:
        setup = next(messages)
    except (StopIteration, OSError, FrameError):
        return 2
    if not isinstance(setup, send_wire.Setup):
        return 2
    if setup.switch_interval_us:
        sys.setswitchinterval(setup.switch_interval_us / 1e6)
    try:
        child = cuda_child(sock, setup)
        child.reply(send_wire.Ready())
        child.serve(messages)
    except (OSError, FrameError):
        return 0  # P closed the socket or exited: nothing left to write for
    except Exception as exc:  # CUDA, torch or P's memory: P writes in its own process from now on
        try:
            sock.sendall(send_wire.encode(send_wire.Broken(f"the send process stopped: {exc}")))
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    # The socket's end ends the process at once: writes in flight are P's to fail, and lanes' threads are not waited for.
    os._exit(main(sys.argv))

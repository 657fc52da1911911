"""The messages between P and its send process (pdkv.transport.sockets.send_process): msgpack, each behind a 4-byte
big-endian length, over a Unix socket pair only the two hold. Pure but for reading a socket."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import msgspec

from pdkv.errors import FrameError
from pdkv.tp_heads import HeadShare
from pdkv.wire import IpcExport, Region

MAX_MESSAGE = 64 << 20  # a Write of ~1.4 million ranges; anything longer is a broken peer
_LEN = struct.Struct(">I")


class Setup(msgspec.Struct, tag=True):
    """P -> child, first: how to write (SocketTransport's settings) and on which GPU."""

    device: int
    connections: int
    write_timeout_s: float
    buffer_bytes: int
    chunk_bytes: int
    staging: str
    switch_interval_us: int
    token: str | None  # the deployment key as P's transport was given it (None: the environment's)


class Memory(msgspec.Struct, tag=True):
    """P -> child: P's registered memory, opened through `export` (its regions: P's spans, in P's addresses)."""

    export: IpcExport


class Write(msgspec.Struct, tag=True):
    """P -> child: write (src, dst, length) ranges, src in P's addresses, to `peer` under `transfer`."""

    ident: int
    peer: str
    transfer: str
    ranges: list[tuple[int, int, int]]
    timeout_s: float


class WriteBlocks(msgspec.Struct, tag=True):
    """P -> child: Transport.write_blocks, P's regions in P's addresses: the child plans the descriptors (P's thread
    would otherwise spend its own Python on them beside the forward)."""

    ident: int
    peer: str
    transfer: str
    local_blocks: list[int]
    remote_blocks: list[int]
    local_regions: list[Region]
    remote_regions: list[Region]
    heads: HeadShare | None
    timeout_s: float


class Ready(msgspec.Struct, tag=True):
    """Child -> P: it can write (its CUDA context and staging are up)."""


class Broken(msgspec.Struct, tag=True):
    """Child -> P: it cannot write at all (why); it exits after."""

    why: str


class Done(msgspec.Struct, tag=True):
    ident: int
    landed: int
    descriptors: int = 0  # WriteBlocks: the writes it took (Written.descriptors)


class Failed(msgspec.Struct, tag=True):
    ident: int
    why: str
    hint: str = ""


Message = Setup | Memory | Write | WriteBlocks | Ready | Broken | Done | Failed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> Message:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise FrameError(f"not a send-process message: {exc}") from None


def messages(sock: socket.socket) -> Iterator[Message]:
    """Every message on `sock` until its end (a clean end between messages); FrameError for a cut or bad one."""
    while True:
        head = _read(sock, _LEN.size, at_start=True)
        if head is None:
            return
        (n,) = _LEN.unpack(head)
        if n > MAX_MESSAGE:
            raise FrameError(f"a message of {n:,} B announced (at most {MAX_MESSAGE:,})")
        body = _read(sock, n, at_start=False)
        assert body is not None
        yield decode(body)


def _read(sock: socket.socket, n: int, *, at_start: bool) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and at_start:
                return None
            raise FrameError(f"the socket ended {got} B into a {n}-byte read")
        got += k
    return bytes(buf)

"""The messages between P and its send process: framing, bounds, and where P's addresses lie in the child."""

from __future__ import annotations

import socket
import struct

import pytest

from pdkv.errors import FrameError, TransferError
from pdkv.transport.sockets import send_wire
from pdkv.transport.sockets.send_main import Translation
from pdkv.tp_heads import HeadShare
from pdkv.wire import IpcAllocation, IpcExport, IpcRegion, Region

EXPORT = IpcExport("boot:host", 4242, 0, "GPU-1", [IpcAllocation(b"h" * 64, 0x7000_0000, 1 << 20)],
                   [IpcRegion(0, 0x7000_0000, 1 << 19), IpcRegion(0, 0x7008_0000, 1 << 19)], 123)
EVERY_KIND = [
    send_wire.Setup(0, 4, 30.0, 98304, 8 << 20, "copies", 200, None),
    send_wire.Setup(1, 2, 5.0, 0, 1 << 20, "kernel", 0, "secret"),
    send_wire.Memory(EXPORT),
    send_wire.Write(7, "socket://127.0.0.1:9/" + "00" * 16, "t/d", [(0x7000_0000, 0x9000_0000, 65536)] * 3, 30.0),
    send_wire.WriteBlocks(8, "socket://127.0.0.1:9/" + "00" * 16, "t/d", [1, 2, 3], [7, 8, 9], [Region(0x7000_0000, 4096, 64)] * 2,
                          [Region(0x9000_0000, 2048, 64)] * 2, HeadShare(0, 4, 4, 8, 16), 30.0),
    send_wire.WriteBlocks(9, "socket://h:9/" + "00" * 16, "", [], [], [], [], None, 1.0),
    send_wire.Ready(), send_wire.Broken("no CUDA"), send_wire.Done(7, 196608), send_wire.Done(8, 1, 2),
    send_wire.Failed(7, "refused", "hint"),
]


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    b.settimeout(5)
    return a, b


def test_every_kind_of_message_reads_back_as_it_was_sent_in_order():
    a, b = _pair()
    with a, b:
        a.sendall(b"".join(send_wire.encode(m) for m in EVERY_KIND))
        a.shutdown(socket.SHUT_WR)
        assert list(send_wire.messages(b)) == EVERY_KIND  # a clean end between messages ends the stream


@pytest.mark.parametrize(("data", "needle"), [
    (struct.pack(">I", send_wire.MAX_MESSAGE + 1), "announced"),  # refused before the body is read
    (send_wire.encode(send_wire.Ready())[:-1], "ended"),  # cut inside the body
    (b"\x00\x00", "ended"),  # cut inside the length
    (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "not a send-process message"),  # not msgpack
    (struct.pack(">I", 2) + b"\x81\xa1", "not a send-process message"),  # msgpack of no known kind
])
def test_a_message_that_is_not_one_is_refused(data: bytes, needle: str):
    a, b = _pair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match=needle):
            list(send_wire.messages(b))


def test_p_s_ranges_map_into_the_child_s_opening_span_by_span_and_nothing_outside_them():
    t = Translation([(0x2000, 0x3000, 0x9_2000), (0x1000, 0x2000, 0x5_0000)])  # any order
    assert t.here(0x1000, 0x1000) == 0x5_0000
    assert t.here(0x1800, 16) == 0x5_0800
    assert t.here(0x2ff0, 16) == 0x9_2ff0
    for addr, n in ((0x0ff0, 16), (0x1ff8, 16), (0x2ff8, 16), (0x3000, 1)):
        with pytest.raises(TransferError, match="outside the memory the send process opened"):
            t.here(addr, n)
    with pytest.raises(TransferError):
        Translation([]).here(0x1000, 1)

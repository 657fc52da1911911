"""Hostile input at the socket transport's listener, seeded: random bytes and mutated handshakes from peers without
the key, then mutated WRITE frames from a peer that holds it. Afterwards no byte outside the granted blocks was
written, every connection is closed, and a valid write still lands."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import numpy as np
import pytest
from support.waiting import wait_for

from pdkv.errors import TransferError
from pdkv.transport import Descriptor
from pdkv.transport.sockets import SocketTransport, wire
from pdkv.transport.sockets.lanes import dial, parse_session

SEED = 20261205
N_STRANGER = 1500
N_KEYED = 600
KEY = "hostile-deployment-key"
SIZE = 64 * 1024
GRANT = (16 * 1024, 16 * 1024)  # offset and length inside D's memory that the transfer "g" may write


def _mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and out:
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        elif op == 1:
            out[rng.randrange(len(out) + 1):0] = rng.randbytes(rng.randint(1, 8))
        elif op == 2 and out:
            del out[rng.randrange(len(out))]
        else:
            out = out[: rng.randrange(len(out) + 1)]
    return bytes(out)


def _stranger_messages(rng: random.Random, session_id: bytes) -> Iterator[bytes]:
    hello = wire.frame(wire.Kind.HELLO, wire.HELLO.pack(session_id, rng.randbytes(16)))
    proof = wire.frame(wire.Kind.PROOF, wire.PROOF.pack(rng.randbytes(32)))
    write = wire.frame(wire.Kind.WRITE, wire.write_body(1, "g", [(0, 8)])) + b"\xee" * 8
    for _ in range(N_STRANGER):
        kind = rng.randrange(4)
        if kind == 0:
            yield rng.randbytes(rng.randint(0, 64))
        elif kind == 1:
            yield _mutate(rng, hello)
        elif kind == 2:
            yield hello + _mutate(rng, proof) + write
        else:
            yield _mutate(rng, write)


def _send(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):
                pass
        except OSError:  # refused and reset: what a listener does to a stranger
            pass


def _keyed_frame(rng: random.Random, base: int) -> bytes:
    """A WRITE frame of an authenticated but hostile P: ranges around the grant's edges, wrong keys, bad counts."""
    start, length = base + GRANT[0], GRANT[1]
    candidates = [
        (start, length), (start - 1, 2), (start + length - 1, 2), (base, 8), (start + length, 8), (start, length + 1),
        (0, 8), (2**64 - 8, 8), (start + rng.randrange(length), rng.randint(1, 64)),
    ]
    ranges = [rng.choice(candidates) for _ in range(rng.randint(1, 3))]
    ranges = [(a, max(1, min(n, 2**64 - a))) for a, n in ranges]
    key = rng.choice(["g", "g", "h", "", "g" * 255])
    payload = sum(n for _, n in ranges)
    body = wire.write_body(rng.randrange(2**32), key, ranges)
    frame = wire.frame(wire.Kind.WRITE, body) + b"\xee" * min(payload, 4096)
    return _mutate(rng, frame) if rng.random() < 0.5 else frame


@pytest.mark.parametrize("seed", [SEED])
def test_the_listener_survives_hostile_input_and_writes_nothing_outside_the_grant(seed: int):
    rng = random.Random(seed)
    mem = np.zeros(SIZE, dtype=np.uint8)
    base = mem.ctypes.data
    with SocketTransport("127.0.0.1", token=KEY, write_timeout_s=5) as d:
        d.register([(base, SIZE)])
        d.expect("g", [(base + GRANT[0], GRANT[1])])
        host, port, session_id = parse_session(d.session_address)
        for data in _stranger_messages(rng, session_id):
            _send(port, data)
        assert d.listener.landed == 0, "a peer without the key landed bytes"
        key = wire.handshake_key(KEY)
        for _ in range(N_KEYED):
            try:
                conn = dial(host, port, session_id, key, 5)
            except TransferError as exc:
                raise AssertionError(f"the listener stopped taking keyed connections: {exc}") from None
            with conn:
                try:
                    conn.sendall(_keyed_frame(rng, base))
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(4096):
                        pass
                except OSError:
                    pass
        assert d.listener.landed > 0, "no keyed frame reached the grant check and passed it: the input is too hostile to test it"
        assert sum(d.listener.refusals.counts.values()) >= N_STRANGER // 2
        outside = np.concatenate([mem[: GRANT[0]], mem[GRANT[0] + GRANT[1]:]])
        assert not outside.any(), "bytes landed outside the granted range"
        wait_for(lambda: d.listener.connections == 0, 10, "every hostile connection to be closed")
        src = np.arange(GRANT[1], dtype=np.uint8)
        with SocketTransport("127.0.0.1", token=KEY, writable=False) as p:
            p.register([(src.ctypes.data, src.nbytes)])
            p.write(d.session_address, [Descriptor(src.ctypes.data, base + GRANT[0], GRANT[1])], transfer="g")
        assert np.array_equal(mem[GRANT[0]: GRANT[0] + GRANT[1]], src)
        assert not np.concatenate([mem[: GRANT[0]], mem[GRANT[0] + GRANT[1]:]]).any()

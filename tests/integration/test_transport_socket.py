"""The socket transport between real processes and sockets on 127.0.0.1: bytes land exactly, many transfers at once,
and what D refuses (unknown transfers, ranges it did not announce, peers without the key), stalls and cuts."""

from __future__ import annotations

import concurrent.futures
import fcntl
import multiprocessing as mp
import socket
import struct
import termios
import threading
import time

import numpy as np
import pytest
from support.stopping import resume_process, stop_process
from support.waiting import wait_for

from pdkv.errors import TransferError
from pdkv.transport import Descriptor, Transport, block_spans, open_transport
from pdkv.transport.sockets import SocketTransport, wire
from pdkv.wire import Region

BL = 64 * 1024
LAYERS, BLOCKS = 3, 64
KEY = "socket-test-key"


def _decode_main(conn, token: str | None, timeout_s: float) -> None:
    """A decode process: zeroed KV regions behind a socket transport; grants and sends its bytes on request."""
    mem = np.zeros(LAYERS * BLOCKS * BL, dtype=np.uint8)
    regions = [Region(mem.ctypes.data + i * BLOCKS * BL, BL, BLOCKS) for i in range(LAYERS)]
    with SocketTransport("127.0.0.1", token=token or "", write_timeout_s=timeout_s) as t:
        t.register([(mem.ctypes.data, mem.nbytes)])
        conn.send((t.session_address, regions))
        while (msg := conn.recv()) != "stop":
            op, key, blocks = msg
            if op == "expect":
                t.expect(key, block_spans(blocks, regions))
                conn.send("ok")
            elif op == "forget":
                t.forget(key)
                conn.send(len(t.grants))
            elif op == "bytes":
                conn.send(mem.tobytes())


class Decode:
    def __init__(self, token: str | None = None, timeout_s: float = 10.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_main, args=(child, token, timeout_s), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "the decode process did not start"
        self.session, self.regions = self.conn.recv()

    def ask(self, *msg):
        self.conn.send(msg)
        assert self.conn.poll(30), f"the decode process did not answer {msg[0]}"
        return self.conn.recv()

    def memory(self) -> np.ndarray:
        return np.frombuffer(self.ask("bytes", "", []), dtype=np.uint8).reshape(LAYERS, BLOCKS, BL)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
            except OSError:  # killed by the test, not yet reaped
                pass
            self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def source():
    rng = np.random.default_rng(7)
    mem = rng.integers(0, 256, LAYERS * BLOCKS * BL, dtype=np.uint8)
    return mem, [Region(mem.ctypes.data + i * BLOCKS * BL, BL, BLOCKS) for i in range(LAYERS)]


def _writer(token: str | None = None, **kw) -> SocketTransport:
    return SocketTransport("127.0.0.1", writable=False, token=token or "", **kw)


def test_it_is_a_transport_chosen_by_name_and_imports_without_torch():
    with open_transport("socket", writable=False) as t:
        assert isinstance(t, Transport) and t.name == "socket" and t.session_address == ""
    with open_transport("socket") as t:
        assert t.session_address.startswith("socket://127.0.0.1:")
    import subprocess
    import sys

    code = "import sys, pdkv.transport.sockets, pdkv.connector.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_socket_buffers_are_the_setting_or_the_transports_default():
    from pdkv.transport.sockets.transport import DEFAULT_BUFFER_BYTES

    for given, want in ((None, DEFAULT_BUFFER_BYTES), (1 << 20, 1 << 20)):
        with open_transport("socket", buffer_bytes=given) as t:
            assert t.buffer_bytes == want
            # Accepted connections inherit the listener's receive buffer; Linux doubles what is asked.
            assert t.listener._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * want


def test_blocks_land_exactly_and_many_transfers_in_flight_share_the_connections(source):
    mem, local = source
    d = Decode()
    try:
        with _writer(connections=3, write_timeout_s=10) as p:
            p.register([(mem.ctypes.data, mem.nbytes)])
            # 16 transfers at once from 8 threads, each its own key and blocks: 4 blocks each, D's blocks reversed.
            jobs = [(f"t{i}", list(range(4 * i, 4 * i + 4)), [BLOCKS - 1 - b for b in range(4 * i, 4 * i + 4)]) for i in range(16)]
            for key, _, rblocks in jobs:
                assert d.ask("expect", key, rblocks) == "ok"
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                done = list(pool.map(lambda j: p.write_blocks(d.session, j[1], j[2], local, d.regions, transfer=j[0]), jobs))
            assert all(w.bytes == LAYERS * 4 * BL for w in done)
            got = d.memory()
            src = mem.reshape(LAYERS, BLOCKS, BL)
            for _, lblocks, rblocks in jobs:
                assert np.array_equal(got[:, rblocks], src[:, lblocks])
            # The connections were kept: one per lane, not one per transfer.
            lanes = p._peers[d.session].lanes
            assert len(lanes) == 3
            for key, _, _ in jobs:
                remaining = d.ask("forget", key, [])
            assert remaining == 0
    finally:
        d.close()


def test_a_write_d_did_not_expect_or_outside_the_blocks_it_announced_is_refused_before_a_byte_lands(source):
    mem, local = source
    d = Decode()
    try:
        with _writer(connections=2, write_timeout_s=10) as p:
            p.register([(mem.ctypes.data, mem.nbytes)])
            assert d.ask("expect", "a", [5, 6]) == "ok"
            with pytest.raises(TransferError, match="no transfer 'b' is expected"):
                p.write_blocks(d.session, [1], [5], local, d.regions, transfer="b")
            with pytest.raises(TransferError, match="outside what transfer 'a' announced"):
                p.write_blocks(d.session, [1, 2], [6, 7], local, d.regions, transfer="a")
            with pytest.raises(TransferError, match="outside what transfer 'a' announced"):
                p.write(d.session, [Descriptor(mem.ctypes.data, d.regions[0].base + 5 * BL - 1, 2)], transfer="a")
            assert not d.memory().any(), "a refused write landed bytes"
            # After the refusals (each closed its connection) the granted write goes through on new connections.
            p.write_blocks(d.session, [1, 2], [5, 6], local, d.regions, transfer="a")
            got, src = d.memory(), mem.reshape(LAYERS, BLOCKS, BL)
            assert np.array_equal(got[:, [5, 6]], src[:, [1, 2]]) and not got[:, 7:].any()
            d.ask("forget", "a", [])
            with pytest.raises(TransferError, match="no transfer 'a'"):
                p.write_blocks(d.session, [1], [5], local, d.regions, transfer="a")
            # P reads only its registered memory.
            with pytest.raises(TransferError, match="outside the registered memory"):
                p.write(d.session, [Descriptor(mem.ctypes.data + mem.nbytes - 8, d.regions[0].base, 16)], transfer="a")
    finally:
        d.close()


def test_only_a_peer_with_the_deployment_key_may_write_and_only_the_d_with_it_receives(source):
    mem, local = source
    d = Decode(token=KEY)
    try:
        assert d.ask("expect", "a", [0]) == "ok"
        for token in (None, "another-key"):
            with _writer(token) as p:
                p.register([(mem.ctypes.data, mem.nbytes)])
                with pytest.raises(TransferError, match="did not prove"):
                    p.write_blocks(d.session, [0], [0], local, d.regions, transfer="a")
        # The right key but another D's session id: refused too.
        host_port, sid = d.session.rsplit("/", 1)
        with _writer(KEY) as p:
            p.register([(mem.ctypes.data, mem.nbytes)])
            with pytest.raises(TransferError, match="another D"):
                p.write_blocks(d.session.replace(sid, "00" * 16), [0], [0], local, d.regions, transfer="a")
            assert not d.memory().any()
            p.write_blocks(d.session, [0], [0], local, d.regions, transfer="a")
        assert np.array_equal(d.memory()[:, 0], mem.reshape(LAYERS, BLOCKS, BL)[:, 0])
        # A P that skips the handshake and sends a WRITE at once: refused, nothing lands.
        host, port = host_port.removeprefix("socket://").rsplit(":", 1)
        start = d.regions[0].base + BL
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(wire.frame(wire.Kind.WRITE, wire.write_body(1, "a", [(start, 8)])) + b"\x01" * 8)
            s.settimeout(5)
            try:
                answer = s.recv(100)
            except ConnectionResetError:  # closed with the payload unread
                answer = b""
            assert answer == b""  # closed without a word: it never said HELLO
        assert not d.memory()[:, 1].any()
    finally:
        d.close()


def test_a_d_that_stalls_fails_the_write_within_its_bound_and_its_peers_writes_go_on(source):
    mem, local = source
    stalled, healthy = Decode(timeout_s=30), Decode()
    try:
        with _writer(write_timeout_s=1.5, connections=2) as p:
            p.register([(mem.ctypes.data, mem.nbytes)])
            blocks = list(range(BLOCKS))
            for d in (stalled, healthy):
                assert d.ask("expect", "a", blocks) == "ok"
            stop_process(stalled.proc.pid)  # every thread stopped: none can still take the write
            try:
                t0 = time.monotonic()
                # Stopped before or after P's connection finished its handshake (a loaded host decides which):
                # either way the write fails within its bound.
                with pytest.raises(TransferError, match="no progress|no answer|handshake with decode's socket listener .* timed out"):
                    p.write_blocks(stalled.session, blocks, blocks, local, stalled.regions, transfer="a")
                assert time.monotonic() - t0 < 5
                p.write_blocks(healthy.session, blocks, blocks, local, healthy.regions, transfer="a")
            finally:
                resume_process(stalled.proc.pid)
        assert np.array_equal(healthy.memory(), mem.reshape(LAYERS, BLOCKS, BL))
    finally:
        stalled.close()
        healthy.close()


def _unsent(sock: socket.socket | None) -> int:
    if sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def test_a_connection_cut_mid_transfer_fails_that_transfer_at_once(source):
    """D stopped, P's write blocked mid-payload (its send queue full), then D killed: the write fails at once,
    long before its 30 s bound."""
    mem, local = source
    d = Decode(timeout_s=30)
    try:
        with _writer(write_timeout_s=30, connections=1) as p:
            p.register([(mem.ctypes.data, mem.nbytes)])
            blocks = list(range(BLOCKS))
            assert d.ask("expect", "a", blocks) == "ok"
            p.write_blocks(d.session, [0], [0], local, d.regions, transfer="a")  # the connection is up
            stop_process(d.proc.pid)
            outcome: dict[str, object] = {}

            def write() -> None:
                try:
                    p.write_blocks(d.session, blocks, blocks, local, d.regions, transfer="a")
                    outcome["done"] = True
                except TransferError as exc:
                    outcome["error"] = exc
                    outcome["at"] = time.monotonic()

            th = threading.Thread(target=write, daemon=True)
            th.start()
            lane = p._peers[d.session].lanes[0]
            wait_for(lambda: _unsent(lane._sock) > 0, 10, "P's write to be blocked mid-payload")
            killed = time.monotonic()
            d.proc.kill()
            th.join(10)
            assert "error" in outcome, outcome
            assert outcome["at"] - killed < 3
    finally:
        d.close()


@pytest.mark.parametrize("bound", ["kernel", "python"])
def test_many_small_ranges_land_whole_however_the_bytes_arrive(bound: str):
    # D receives scattered blocks with one recvmsg_into per up to IOV_MAX ranges: the bytes come in pieces that end
    # anywhere inside a range, and more ranges than one call takes; on a blocking socket bounded by the kernel (the
    # transport's) and on one with a Python timeout alike.
    from pdkv.transport.sockets.streams import IOV_MAX, bound_waits, recv_views

    rng = np.random.default_rng(7)
    sizes = [int(n) for n in rng.integers(1, 300, size=IOV_MAX + 500)]
    payload = rng.integers(0, 255, size=sum(sizes), dtype=np.uint8).tobytes()
    dst = np.zeros(sum(sizes) + 2 * len(sizes), dtype=np.uint8)  # one byte of gap before and after each range
    views, off = [], 0
    for n in sizes:
        views.append(memoryview(dst)[off + 1 : off + 1 + n])
        off += n + 2
    a, b = socket.socketpair()
    with a, b:
        if bound == "kernel":
            bound_waits(b, 10)
        else:
            b.settimeout(10)

        def send() -> None:
            pos = 0
            while pos < len(payload):
                step = int(rng.integers(1, 5000))
                a.sendall(payload[pos : pos + step])
                pos += step

        sender = threading.Thread(target=send)
        sender.start()
        recv_views(b, views)
        sender.join()
    assert b"".join(bytes(v) for v in views) == payload
    gaps = np.ones(len(dst), dtype=bool)
    for v, start in zip(views, np.cumsum([0] + [n + 2 for n in sizes[:-1]]), strict=True):
        gaps[start + 1 : start + 1 + len(v)] = False
    assert not dst[gaps].any()


def test_a_peer_that_closes_mid_range_fails_the_receive():
    from pdkv.transport.sockets.streams import recv_views

    a, b = socket.socketpair()
    with b:
        b.settimeout(10)
        a.sendall(b"x" * 100)
        a.close()
        with pytest.raises(TransferError, match="closed after 100 of 150 bytes"):
            recv_views(b, [memoryview(bytearray(50)), memoryview(bytearray(100))])


def test_a_bounded_wait_ends_at_its_bound_and_a_shutdown_ends_it_at_once():
    """The transport's sockets block in the kernel (bound_waits): a receive from a silent peer and a send to a peer
    that reads nothing fail at their bound; a receive blocked mid-range ends as soon as another thread shuts the
    socket down (what P's abort and D's close do)."""
    from pdkv.transport.sockets.streams import WAIT_EXPIRED, bound_waits, recv_views, send_views

    a, b = socket.socketpair()
    with a, b:
        bound_waits(b, 0.3)
        t0 = time.monotonic()
        with pytest.raises(WAIT_EXPIRED):
            recv_views(b, [memoryview(bytearray(10))])
        assert 0.25 < time.monotonic() - t0 < 3
        bound_waits(a, 0.3)
        t0 = time.monotonic()
        with pytest.raises(WAIT_EXPIRED):
            send_views(a, [memoryview(bytearray(64 << 20))])  # far more than both socket buffers hold
        assert time.monotonic() - t0 < 5
    a, b = socket.socketpair()
    with a, b:
        bound_waits(b, 30)
        a.sendall(b"x" * 10)
        outcome: dict[str, object] = {}

        def receive() -> None:
            outcome["tid"] = threading.get_native_id()
            try:
                recv_views(b, [memoryview(bytearray(100))])
            except TransferError as exc:
                outcome["error"] = exc

        def asleep_in_the_kernel() -> bool:  # waiting for bytes (not for the GIL, not yet running)
            try:
                with open(f"/proc/self/task/{outcome['tid']}/wchan") as f:
                    where = f.read()
            except (KeyError, OSError):
                return False
            return where not in ("", "0") and "futex" not in where

        th = threading.Thread(target=receive, daemon=True)
        th.start()
        wait_for(asleep_in_the_kernel, 10, "the receive to block in the kernel")
        t0 = time.monotonic()
        b.shutdown(socket.SHUT_RDWR)
        th.join(5)
        assert not th.is_alive() and time.monotonic() - t0 < 2
        assert "closed after 10 of 100 bytes" in str(outcome.get("error"))

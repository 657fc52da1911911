"""P's side of the socket transport: N connections per D, kept and reused, each with a thread of its own.

A transfer's ranges are split by bytes over the connections (`split`), each share is one or more WRITE frames on its
connection, and the transfer returns once every connection's ACKs came back: then every byte has landed in D's
memory. A connection that fails (cut, refused, silent past its bound) fails its share at once and is closed; the
next transfer opens a new one. Writes on one connection run in the order they were asked for.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

from pdkv.errors import TransferError
from pdkv.transport.sockets import wire
from pdkv.transport.sockets.streams import WAIT_EXPIRED, bound_waits, read_frame

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
REUSE_IDLE_S = 300.0  # a connection idle longer is opened anew (D closes them after its idle bound, 600 s)
MIN_SHARE_BYTES = 1 << 20  # a transfer smaller than N of these uses fewer connections


def split(ranges: Sequence[tuple[int, int, int]], lanes: int, min_share: int = MIN_SHARE_BYTES) -> list[list[tuple[int, int, int]]]:
    """(src, dst, length) ranges cut into at most `lanes` shares of nearly equal bytes, in order; a range is cut where
    a share ends. Fewer shares when the bytes are few (each at least `min_share`, but always one)."""
    ranges = [r for r in ranges if r[2] > 0]
    ends = list(itertools.accumulate(n for _, _, n in ranges))  # where each range ends in the transfer's bytes
    total = ends[-1] if ends else 0
    if total <= 0:
        return []
    count = max(1, min(lanes, total // max(1, min_share)))
    target = -(-total // count)
    shares: list[list[tuple[int, int, int]]] = []
    for start in range(0, total, target):
        stop = min(total, start + target)
        # The share is bytes [start, stop): whole ranges sliced out of the list, the two at its edges cut. Thousands
        # of scattered blocks make thousands of ranges; only the edges are looked at one by one.
        first, last = bisect.bisect_right(ends, start), bisect.bisect_left(ends, stop)
        head_off = start - (ends[first] - ranges[first][2])
        if first == last:
            shares.append([_cut(ranges[first], head_off, stop - start)])
            continue
        tail_len = stop - (ends[last] - ranges[last][2])
        head_len = ranges[first][2] - head_off
        shares.append([_cut(ranges[first], head_off, head_len), *ranges[first + 1 : last], _cut(ranges[last], 0, tail_len)])
    return shares


def _cut(r: tuple[int, int, int], off: int, length: int) -> tuple[int, int, int]:
    return r if off == 0 and length == r[2] else (r[0] + off, r[1] + off, length)


def parse_session(session: str) -> tuple[str, int, bytes]:
    """(host, port, session id) from `socket://host:port/<session id hex>`; TransferError if malformed."""
    bad = TransferError(f"{session!r} is not a socket transport address: use the same mooncake_protocol on P and D")
    if not session.startswith("socket://"):
        raise bad
    hostport, _, sid = session[len("socket://") :].partition("/")
    host, _, port = hostport.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        session_id = bytes.fromhex(sid)
        port_no = int(port)
    except ValueError:
        raise bad from None
    if not host or not 0 < port_no < 65536 or len(session_id) != wire.SESSION_ID_BYTES:
        raise bad
    return host, port_no, session_id


def dial(host: str, port: int, session_id: bytes, key: bytes, timeout_s: float, buffer_bytes: int = 0) -> socket.socket:
    """A connection to D's listener that passed the handshake: D proved it holds the key and is the session.
    `buffer_bytes`: its send buffer (SO_SNDBUF; 0: the kernel's autotuning)."""
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout_s, CONNECT_TIMEOUT_S))
    except OSError as exc:
        raise TransferError(f"cannot connect to decode's socket listener {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        bound_waits(sock, timeout_s)
        p_nonce = secrets.token_bytes(wire.NONCE_BYTES)
        sock.sendall(wire.frame(wire.Kind.HELLO, wire.HELLO.pack(session_id, p_nonce)))
        kind, body = read_frame(sock, (wire.Kind.CHALLENGE, wire.Kind.REFUSE))
        if kind == wire.Kind.REFUSE:
            raise TransferError(f"decode's socket listener {host}:{port} refused the connection: {body.decode(errors='replace')}")
        d_nonce, d_proof = wire.CHALLENGE.unpack(body)
        if not wire.proof_ok(key, b"d", session_id, p_nonce, d_nonce, d_proof):
            raise TransferError(f"{host}:{port} did not prove it holds the deployment key and this session",
                                hint="P and D need the same PDKV_TOKEN; or another process holds that port")
        sock.sendall(wire.frame(wire.Kind.PROOF, wire.PROOF.pack(wire.proof(key, b"p", session_id, p_nonce, d_nonce))))
        kind, body = read_frame(sock, (wire.Kind.READY, wire.Kind.REFUSE))
        if kind == wire.Kind.REFUSE:
            raise TransferError(f"decode's socket listener refused this engine: {body.decode(errors='replace')}",
                                hint="P and D need the same PDKV_TOKEN")
        return sock
    except BaseException as exc:
        sock.close()
        if isinstance(exc, (OSError, wire.FrameError)):
            raise TransferError(f"handshake with decode's socket listener {host}:{port} failed: {exc}") from None
        raise


def _refusal(sock: socket.socket) -> str | None:
    """D's REFUSE reason, if one is waiting on `sock` (D refuses, then closes: P's send then fails first)."""
    try:
        sock.settimeout(0.2)
        kind, body = read_frame(sock, (wire.Kind.REFUSE, wire.Kind.ACK))
    except (OSError, TransferError, wire.FrameError):
        return None
    return f"decode refused the write: {body.decode(errors='replace')}" if kind == wire.Kind.REFUSE else None


class Lane:
    """One connection to one D and the thread that uses it. `submit` queues a share; the thread connects when it
    has none (or its last one failed or idled past REUSE_IDLE_S)."""

    def __init__(self, name: str, connect: Callable[[], socket.socket], memory: Callable[[], Any], timeout_s: float) -> None:
        self._connect = connect
        self._make_memory = memory
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[tuple[Future[int], str, list[tuple[int, int, int]]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None  # owned by the lane's thread; _lock guards its swap with abort()
        self._used = 0.0
        self._seq = 0
        self._memory: Any = None  # owned by the lane's thread
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: str, share: list[tuple[int, int, int]]) -> Future[int]:
        fut: Future[int] = Future()
        self._jobs.put((fut, key, share))
        return fut

    def abort(self) -> None:
        """Close the connection under the thread's feet: its send or wait fails at once (the share then fails)."""
        with self._lock:
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, key, share = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self._write(key, share))
            except BaseException as exc:  # handed to the transfer's caller
                self._drop()
                fut.set_exception(exc if isinstance(exc, TransferError) else TransferError(f"socket write failed: {exc}"))
        self._drop()
        if self._memory is not None:
            self._memory.close()

    def _drop(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _socket(self) -> socket.socket:
        if self._sock is not None and time.monotonic() - self._used > REUSE_IDLE_S:
            self._drop()
        if self._sock is None:
            sock = self._connect()
            with self._lock:
                self._sock = sock
        if self._memory is None:
            self._memory = self._make_memory()
        assert self._sock is not None
        return self._sock

    def _write(self, key: str, share: list[tuple[int, int, int]]) -> int:
        sock = self._socket()
        frames = [share[i : i + wire.MAX_RANGES] for i in range(0, len(share), wire.MAX_RANGES)]
        first = self._seq
        try:
            for part in frames:
                self._seq += 1
                body = wire.write_body(self._seq, key, [(dst, n) for _, dst, n in part])
                self._memory.send(sock, [(src, n) for src, _, n in part], wire.frame(wire.Kind.WRITE, body))
            landed = 0
            for i in range(len(frames)):
                kind, body = read_frame(sock, (wire.Kind.ACK, wire.Kind.REFUSE))
                if kind == wire.Kind.REFUSE:
                    raise TransferError(f"decode refused the write: {body.decode(errors='replace')}")
                seq, nbytes = wire.ACK.unpack(body)
                if seq != first + 1 + i:
                    raise TransferError(f"decode acknowledged write {seq}, {first + 1 + i} was due")
                landed += nbytes
        except WAIT_EXPIRED:
            raise TransferError(f"decode's socket listener made no progress within {self.timeout_s:g} s",
                                hint="is the decode process stopped or overloaded?") from None
        except (OSError, wire.FrameError) as exc:
            raise TransferError(f"the connection to decode's socket listener failed mid-transfer: {_refusal(sock) or exc}") from None
        self._used = time.monotonic()
        return landed

    def retire(self) -> None:
        self._jobs.put(None)
        self.abort()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class PeerLanes:
    """The N lanes to one D. Safe from any thread (lanes take jobs from any thread)."""

    def __init__(self, session: str, key: bytes, lanes: int, memory: Callable[[], Any], timeout_s: float, buffer_bytes: int = 0) -> None:
        host, port, session_id = parse_session(session)
        self.timeout_s = timeout_s

        def connect() -> socket.socket:
            return dial(host, port, session_id, key, timeout_s, buffer_bytes)

        self.lanes = [Lane(f"pdkv-socket-send {host}:{port}/{i}", connect, memory, timeout_s) for i in range(lanes)]

    def write(self, key: str, ranges: Sequence[tuple[int, int, int]], timeout_s: float | None = None) -> int:
        """Write (src, dst, length) ranges under `key`; return the bytes D acknowledged, all landed. TransferError
        at the first failing share (the others are aborted) or when `timeout_s` passes."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        shares = split(ranges, len(self.lanes))
        futures = [(lane, lane.submit(key, share)) for lane, share in zip(self.lanes, shares, strict=False)]
        try:
            # One wait for every share (it returns at the first failure): this thread wakes once, not once a share;
            # each wake-up takes the interpreter's lock from the engine's threads.
            done, pending = wait([f for _, f in futures], timeout=bound, return_when=FIRST_EXCEPTION)
            if failed := next((exc for f in done if (exc := f.exception()) is not None), None):
                raise failed
            if pending:
                raise TransferError(f"socket write of {sum(n for _, _, n in ranges):,} B got no answer within {bound:g} s",
                                    hint="is the decode process stopped or overloaded?")
            total = sum(fut.result() for _, fut in futures)
        except BaseException:
            for lane, fut in futures:
                if not fut.cancel() and not fut.done():
                    lane.abort()  # running: its connection is closed, so it fails now rather than at its bound
            raise
        return total

    def close(self, timeout_s: float = 5.0) -> None:
        for lane in self.lanes:
            lane.retire()
        deadline = time.monotonic() + timeout_s
        for lane in self.lanes:
            lane.join(max(0.0, deadline - time.monotonic()))

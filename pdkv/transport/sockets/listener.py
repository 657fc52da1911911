"""D's side of the socket transport: one listener, a thread per connection, every write checked before it lands.

A connection first proves itself (the handshake of pdkv.transport.sockets.wire: both ends show they hold the
deployment key and name this listener's session id), then carries WRITE frames one after another. Before one byte
of a write's payload is read, every range of the frame must lie inside what its key was granted (Grants, from the
pulls this D announced); anything else is answered REFUSE and the connection is closed, the payload unread.

Every wait is bounded: the handshake by `handshake_timeout_s`; a frame, once its first byte came, and each step of
its payload by `progress_timeout_s`; a connection idle longer than `idle_timeout_s` between frames is closed (P
opens a new one for its next write).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
from collections.abc import Callable

from pdkv.auth import RefusalLog
from pdkv.errors import StartError, TransferError
from pdkv.transport.sockets import wire
from pdkv.transport.sockets.streams import WAIT_EXPIRED, bound_waits, read_frame, recv_exact

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
PROGRESS_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 600.0
MAX_CONNECTIONS = 256


class SocketListener:
    """Accepts P's connections on host:port (0: a free port) and lands their writes in this process's memory.

    `memory()` makes the object that receives a write's payload for one connection (HostMemory, or a CudaStaging of
    its own). Threads: one accept loop, one per connection; `grants` and the connection set are shared (the first
    guards itself, the second is guarded by `_lock`).
    """

    def __init__(
        self, host: str, port: int, grants: wire.Grants, *, key: bytes, memory: Callable[[], object],
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, progress_timeout_s: float = PROGRESS_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S, buffer_bytes: int = 0,
    ) -> None:
        """`buffer_bytes`: each connection's receive buffer (SO_RCVBUF; 0: the kernel's autotuning)."""
        self.session_id = secrets.token_bytes(wire.SESSION_ID_BYTES)
        self.grants = grants
        self._key = key
        self._memory = memory
        self.handshake_timeout_s, self.progress_timeout_s, self.idle_timeout_s = handshake_timeout_s, progress_timeout_s, idle_timeout_s
        self.refusals = RefusalLog("socket transport", "the connection is closed")
        self.landed = 0  # bytes written into this process; guarded by _lock
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if buffer_bytes:  # set before listen(): accepted connections inherit it
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise StartError(f"the socket transport cannot listen on {host}:{port}: {exc.strerror}",
                             hint="pick another socket_port, or 0 for a free one") from None
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()  # guarded by _lock
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"pdkv-socket-listen {self.port}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._conns.add(conn)
            peer = str(addr[0])  # refusals are logged once a minute per host, not per connection
            threading.Thread(target=self._serve, args=(conn, peer), name=f"pdkv-socket-conn {peer}:{addr[1]}", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        memory = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            bound_waits(conn, self.handshake_timeout_s)
            if not self._handshake(conn, peer):
                return
            memory = self._memory()
            while self._one_write(conn, peer, memory):
                pass
        except (OSError, TransferError, wire.FrameError) as exc:
            log.debug("socket transport: connection from %s ends: %s", peer, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if memory is not None:
                memory.close()

    def _handshake(self, conn: socket.socket, peer: str) -> bool:
        try:
            _, body = read_frame(conn, (wire.Kind.HELLO,))
            session_id, p_nonce = wire.HELLO.unpack(body)
        except (wire.FrameError, TransferError, OSError, ValueError) as exc:
            self.refusals.refused(peer, f"no valid HELLO: {exc}")
            return False
        if session_id != self.session_id:
            self._refuse(conn, peer, "this listener is another D (session id differs)")
            return False
        d_nonce = secrets.token_bytes(wire.NONCE_BYTES)
        conn.sendall(wire.frame(wire.Kind.CHALLENGE, wire.CHALLENGE.pack(
            d_nonce, wire.proof(self._key, b"d", session_id, p_nonce, d_nonce))))
        try:
            _, body = read_frame(conn, (wire.Kind.PROOF,))
            (given,) = wire.PROOF.unpack(body)
        except (wire.FrameError, TransferError, OSError, ValueError) as exc:
            self.refusals.refused(peer, f"no valid PROOF: {exc}")
            return False
        if not wire.proof_ok(self._key, b"p", session_id, p_nonce, d_nonce, given):
            self._refuse(conn, peer, "unauthenticated: the proof does not match (deployment keys differ)")
            return False
        conn.sendall(wire.frame(wire.Kind.READY))
        return True

    def _one_write(self, conn: socket.socket, peer: str, memory) -> bool:
        """Serve one WRITE frame; False when the connection ends (idle too long, closed, refused)."""
        bound_waits(conn, self.idle_timeout_s)
        try:
            first = conn.recv(1)
        except WAIT_EXPIRED:
            return False
        if not first:
            return False
        bound_waits(conn, self.progress_timeout_s)
        try:
            _, length = wire.read_head(first + recv_exact(conn, wire.HEAD.size - 1), (wire.Kind.WRITE,))
            seq, key, ranges = wire.parse_write(recv_exact(conn, length))
        except wire.FrameError as exc:
            self._refuse(conn, peer, str(exc))
            return False
        why = self.grants.refusal(key, ranges)
        if why is not None:
            self._refuse(conn, peer, why)
            return False
        memory.receive(conn, ranges)
        total = sum(n for _, n in ranges)
        with self._lock:
            self.landed += total
        conn.sendall(wire.frame(wire.Kind.ACK, wire.ACK.pack(seq, total)))
        return True

    def _refuse(self, conn: socket.socket, peer: str, why: str) -> None:
        self.refusals.refused(peer, why)
        with contextlib.suppress(OSError):
            conn.sendall(wire.frame(wire.Kind.REFUSE, why.encode()[: wire.MAX_REASON_BYTES]))

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        """Stop accepting and end every connection (a payload being received fails on P's side at once)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)

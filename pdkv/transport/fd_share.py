"""Handing file descriptors to another process of this host: how D's KV memory, exported by the CUDA driver as
POSIX file descriptors (vLLM 0.34's extensible KV cache), reaches the P that was told where to fetch them.

D serves its descriptors on an abstract Unix socket (no file on disk; a random name). A client sends a short
hello (magic, version, a 32-byte token) and gets every descriptor at once (SCM_RIGHTS) with their count; then
the connection closes. The token exists only inside D's ipc export, which travels over the side channel
(authenticated where the deployment has a key), so only a P that D answered can fetch. A wrong token, a
client of another user, a malformed hello or one that does not arrive within the bound gets nothing. Every
wait is bounded. The socket is Linux's (abstract names, SO_PEERCRED), as is CUDA's POSIX handle type.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading

from pdkv.errors import TransferError

__all__ = ["FD_WAIT_S", "FdServer", "fetch_fds"]

log = logging.getLogger(__name__)

MAGIC = b"PKFD"
VERSION = 1
TOKEN_BYTES = 32
_HELLO = struct.Struct(f"!4sB{TOKEN_BYTES}s")  # magic, version, token
_ANSWER = struct.Struct("!4sBI")  # magic, status (0 ok), descriptor count
MAX_FDS = 4096  # far above one engine's layers; bounds what a client accepts
FD_WAIT_S = 5.0


class FdServer:
    """Serves `fds` (owned by the caller, who closes them after `close()`) to clients that send `token`.

    One daemon thread accepts; each client is answered within `wait_s` or dropped. A context manager.
    """

    def __init__(self, fds: list[int], *, wait_s: float = FD_WAIT_S) -> None:
        if len(fds) > MAX_FDS:
            raise ValueError(f"{len(fds)} descriptors is more than one answer carries ({MAX_FDS})")
        self.fds = list(fds)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.name = f"pdkv-fds-{os.getpid()}-{secrets.token_hex(8)}"
        self.wait_s = wait_s
        self.refused = 0  # hellos that got nothing; owned by the accept thread
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pdkv-fd-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except OSError as exc:
                    self.refused += 1
                    log.warning("pdkv: KV memory descriptors not handed over: %s", exc)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(self.wait_s)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        hello = _recv_exact(conn, _HELLO.size)
        magic, version, token = _HELLO.unpack(hello) if hello is not None else (b"", 0, b"")
        if uid != os.getuid() or magic != MAGIC or version != VERSION or not hmac.compare_digest(token, self.token):
            self.refused += 1
            conn.sendall(_ANSWER.pack(MAGIC, 1, 0))
            return
        socket.send_fds(conn, [_ANSWER.pack(MAGIC, 0, len(self.fds))], self.fds)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(timeout=2.0)

    def __enter__(self) -> FdServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def fetch_fds(name: str, token: bytes, count: int, *, wait_s: float = FD_WAIT_S) -> list[int]:
    """The `count` descriptors served as `name` for `token`, now owned by the caller; TransferError otherwise
    (no such server, refused, a different count, or no answer within `wait_s`)."""
    if not 0 <= count <= MAX_FDS or len(token) != TOKEN_BYTES:
        raise TransferError(f"cannot fetch {count} KV memory descriptors with a {len(token)}-byte token")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(wait_s)
        try:
            sock.connect("\0" + name)
            sock.sendall(_HELLO.pack(MAGIC, VERSION, token))
            msg, fds, _, _ = socket.recv_fds(sock, _ANSWER.size, max(count, 1))
        except OSError as exc:
            raise TransferError(f"could not fetch decode's KV memory descriptors from {name}: {exc}",
                                hint="P and D must run on one host as one user for ipc") from exc
    try:
        if len(msg) != _ANSWER.size:
            raise TransferError(f"decode's descriptor server {name} answered {len(msg)} bytes")
        magic, status, announced = _ANSWER.unpack(msg)
        if magic != MAGIC or status != 0:
            raise TransferError(f"decode's descriptor server {name} refused (status {status})",
                                hint="a stale or forged ipc export; the next pull exports anew")
        if announced != count or len(fds) != count:
            raise TransferError(f"decode's descriptor server {name} sent {len(fds)} of {announced} descriptors, expected {count}")
    except TransferError:
        for fd in fds:
            os.close(fd)
        raise
    return fds

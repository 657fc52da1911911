"""A loopback TCP forwarder that holds each connection for a while before it reaches the server behind it: a
server that answers late (as the bootstrap server on a host whose cores are all busy), with the real server's
answers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from urllib.parse import urlsplit


class LateForwarder:
    """Listens on 127.0.0.1; each connection is forwarded to `target` (an http:// URL) `delay_s` after it came.
    A context manager; `url` is its own address, in `target`'s form."""

    def __init__(self, target: str, delay_s: float) -> None:
        parts = urlsplit(target)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"{parts.scheme}://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._open: list[socket.socket] = []  # guarded by _lock
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="late-forwarder", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._forward, args=(client,), daemon=True).start()

    def _forward(self, client: socket.socket) -> None:
        time.sleep(self.delay_s)
        try:
            upstream = socket.create_connection(self._upstream, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._open += [client, upstream]
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.close()

    def __enter__(self) -> LateForwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)

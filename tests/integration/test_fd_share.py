"""Handing KV memory descriptors to P (pdkv.transport.fd_share) over a real abstract Unix socket: the descriptors
a client receives are the server's files; a wrong token, a forged hello or a silent client get nothing, within
the bound. CUDA VMM allocations cannot exist here, so the descriptors are memfds: the same kernel path."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from pdkv.errors import TransferError
from pdkv.transport.fd_share import MAGIC, VERSION, FdServer, fetch_fds


@pytest.fixture
def memfds():
    fds = []
    for i in range(3):
        fd = os.memfd_create(f"pdkv-test-{i}")
        os.write(fd, f"segment {i}".encode())
        fds.append(fd)
    yield fds
    for fd in fds:
        os.close(fd)


def _content(fd: int) -> bytes:
    return os.pread(fd, 64, 0)


def test_a_client_with_the_token_gets_every_descriptor_in_order(memfds):
    with FdServer(memfds) as server:
        got = fetch_fds(server.name, server.token, 3)
        try:
            assert [_content(fd) for fd in got] == [b"segment 0", b"segment 1", b"segment 2"]
            assert set(got).isdisjoint(memfds)  # new descriptors of the same files, owned by the caller
        finally:
            for fd in got:
                os.close(fd)
        # many clients at once, each answered
        results: list[list[bytes]] = []

        def fetch():
            fds = fetch_fds(server.name, server.token, 3)
            results.append([_content(fd) for fd in fds])
            for fd in fds:
                os.close(fd)

        threads = [threading.Thread(target=fetch) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert len(results) == 16 and all(r == [b"segment 0", b"segment 1", b"segment 2"] for r in results)
        assert server.refused == 0


def test_a_wrong_token_or_count_gets_nothing(memfds):
    with FdServer(memfds) as server:
        with pytest.raises(TransferError, match="refused"):
            fetch_fds(server.name, bytes(32), 3)
        with pytest.raises(TransferError, match="sent 3 of 3 descriptors, expected 2|expected 2"):
            fetch_fds(server.name, server.token, 2)
        assert server.refused == 1
        with pytest.raises(TransferError, match="5-byte token"):
            fetch_fds(server.name, b"short", 3)
    with pytest.raises(TransferError, match="could not fetch"):
        fetch_fds(server.name, server.token, 3)  # closed: no such server


@pytest.mark.parametrize("hello", [b"", b"GET / HTTP/1.1\r\n\r\n" + bytes(32), struct.pack("!4sB32s", MAGIC, VERSION + 1, bytes(32))])
def test_forged_or_silent_hellos_are_refused_within_the_bound(memfds, hello):
    with FdServer(memfds, wait_s=0.5) as server:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect("\0" + server.name)
            sock.sendall(hello)
            start = time.monotonic()
            msg, fds, _, _ = socket.recv_fds(sock, 64, 8)
            assert fds == [] and time.monotonic() - start < 3
            assert msg == b"" or msg[4] != 0  # closed, or status "refused"
        # the server still answers the real client after a hostile one
        good = fetch_fds(server.name, server.token, 3)
        for fd in good:
            os.close(fd)
        assert server.refused == 1


def test_a_server_that_never_answers_fails_the_fetch_within_the_bound():
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind("\0pdkv-fds-test-mute")
        mute.listen(1)
        start = time.monotonic()
        with pytest.raises(TransferError, match="could not fetch"):
            fetch_fds("pdkv-fds-test-mute", bytes(32), 1, wait_s=0.5)
        assert time.monotonic() - start < 3

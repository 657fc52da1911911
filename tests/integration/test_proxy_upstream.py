"""The proxy's upstream connections against a real backend socket that goes away at the worst moment."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest

import pdkv.proxy.http as upstream
from pdkv.proxy.http import UpstreamError, UpstreamPool, fetch

try:
    import uvloop
except ImportError:  # the proxy runs on asyncio's own loop then
    uvloop = None

LOOPS = ["asyncio"] + (["uvloop"] if uvloop is not None else [])


def run(loop_kind: str, coro) -> object:
    if loop_kind == "uvloop":
        return uvloop.run(coro)
    return asyncio.run(coro)


async def resetting_server() -> tuple[asyncio.AbstractServer, int]:
    """A backend that accepts each connection and resets it at once, as a process killed under load does."""

    def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(accepted, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_connection_the_backend_closes_before_the_request_is_written_fails_at_once(monkeypatch, loop_kind):
    """The backend accepts, then is gone before the proxy writes the request: the request fails as a connect
    failure (nothing was sent, so another backend may take it) at once, not at its deadline."""
    real_connect = upstream.connect_bounded

    async def connect_then_lose(factory, host, port, timeout):
        transport, conn = await real_connect(factory, host, port, timeout)
        deadline = time.monotonic() + 5
        while not conn.closed:  # the order that hung: the reset is seen before the request is attached
            assert time.monotonic() < deadline, "the backend's reset never arrived"
            await asyncio.sleep(0.01)
        return transport, conn

    monkeypatch.setattr(upstream, "connect_bounded", connect_then_lose)

    async def main() -> tuple[UpstreamError, float, int]:
        server, port = await resetting_server()
        pool = UpstreamPool(f"http://127.0.0.1:{port}", connect_timeout=5)
        t0 = time.monotonic()
        with pytest.raises(UpstreamError) as err:
            await fetch(pool, "POST", "/v1/completions", body=b"{}", timeout=60)
        took = time.monotonic() - t0
        server.close()
        return err.value, took, len(pool._open)

    error, took, still_open = run(loop_kind, main())
    assert error.cause == "connect", error
    assert "closed the connection before the request was sent" in str(error)
    assert took < 5, f"the request waited {took:.1f} s for a connection that was already gone"
    assert still_open == 0

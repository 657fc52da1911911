"""D's side-channel connection to a P that gets no core for a few seconds (a real child process, stopped with
SIGSTOP: its ZMQ thread cannot answer D's heartbeats, as on a host whose cores P and D share under load).

Within the heartbeat bound (D's receiver sets it to its liveness bound) the connection lives through the stall;
past it, the connection is reported lost with the bound and P's silence in the warning, and is made again,
with `lost` cleared, as soon as P runs again.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.waiting import wait_for

from pdkv.connector.side_channel import SideChannelPeer
from pdkv.wire import ErrorReply
from pdkv.service import EventLoopThread

# A P stand-in: a ROUTER that answers every frame with the frame itself.
ECHO = """
import zmq
sock = zmq.Context().socket(zmq.ROUTER)
print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    sock.send_multipart(sock.recv_multipart())
"""
STALL_S = 2.5


@pytest.fixture
def echo() -> Iterator[tuple[subprocess.Popen, str]]:
    proc = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc, f"tcp://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


class Client:
    """A SideChannelPeer on a loop thread of its own, recording replies and losses."""

    def __init__(self, address: str, heartbeat_timeout_ms: int) -> None:
        import zmq.asyncio

        self.replies: list[Any] = []
        self.losses: list[str] = []
        self.loop = EventLoopThread("stall-test")
        self.ctx = zmq.asyncio.Context()

        async def make() -> SideChannelPeer:
            return SideChannelPeer(self.ctx, address, self.replies.append, self.losses.append, heartbeat_timeout_ms=heartbeat_timeout_ms)

        self.peer = self.loop.submit(make()).result(5)

    def ask(self, text: str, timeout: float = 5.0) -> None:
        n = len(self.replies)
        self.loop.submit(self.peer.send(ErrorReply(error=text))).result(5)
        wait_for(lambda: len(self.replies) > n, timeout, f"the echo of {text!r}")
        assert self.replies[-1] == ErrorReply(error=text)

    def close(self) -> None:
        async def close() -> None:
            self.peer.close()
            self.ctx.term()

        self.loop.submit(close()).result(5)
        self.loop.stop()


def stall(proc: subprocess.Popen, seconds: float) -> None:
    proc.send_signal(signal.SIGSTOP)
    time.sleep(seconds)
    proc.send_signal(signal.SIGCONT)


def test_a_stall_within_the_heartbeat_bound_keeps_the_connection(echo):
    proc, address = echo
    client = Client(address, heartbeat_timeout_ms=int(3 * STALL_S * 1000))
    try:
        client.ask("before")
        stall(proc, STALL_S)  # longer than the 1 s heartbeat interval: pings go unanswered meanwhile
        client.ask("after")
        assert client.losses == [] and not client.peer.lost
    finally:
        client.close()


def test_a_stall_past_the_heartbeat_bound_is_reported_with_why_then_reconnected(echo, caplog):
    proc, address = echo
    client = Client(address, heartbeat_timeout_ms=1000)
    try:
        client.ask("before")
        with caplog.at_level(logging.WARNING, logger="pdkv.connector"):
            stall(proc, STALL_S)
            wait_for(lambda: client.losses, 5.0, "the loss")
            assert client.losses == [address]
            client.ask("after", timeout=10.0)  # ZMQ connects again once P runs
            wait_for(lambda: not client.peer.lost, 5.0, "the connection made again")
        lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
        assert lost and "after P's last frame" in lost[0] and "unanswered for 1 s" in lost[0], lost
        assert any("made again" in r.getMessage() for r in caplog.records)
    finally:
        client.close()

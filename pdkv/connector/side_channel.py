"""The connector's ends of the ZMQ side channel between D's and P's workers, on a private asyncio loop thread.

P binds a ROUTER (`SideChannelServer`); D keeps one DEALER per P worker
(`SideChannelPeer`). The split: the wire itself (the messages, their msgpack
framing, the seal directions, and the one-shot client that tools outside the
connector use) is pdkv.wire.side_channel; this module is the connector's
long-lived server and peer, which speak it. With the deployment key set (a
`FrameSealer`, pdkv.auth) every frame both ways is sealed, and a frame that is
unauthenticated, stale or replayed is dropped unanswered, counted and logged
(once a minute per peer) before it is decoded. The server decodes strictly
and answers an undecodable authentic frame with an ErrorReply; an exception
in a handler is logged and answered, so the listener never dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from pdkv.auth import FrameSealer, RefusalLog
from pdkv.errors import StartError
from pdkv.wire import TO_D, TO_P, ErrorReply, decode_reply, decode_request, encode
from pdkv.service import EventLoopThread  # the sender's and receiver's loop: one home, in pdkv.service

log = logging.getLogger("pdkv.connector")

MAX_FRAME_BYTES = 64 * 1024 * 1024  # a pull for a million blocks is ~10 MB; anything larger is hostile
# D's DEALER pings P's connection this often and drops it when no answer comes for the timeout (a cut link).
# P's ZMQ thread answers the ping; on a host whose cores P and D share it may not run for seconds, so D's
# receiver sets the timeout to its liveness bound, the silence it allows P anyway (SideChannelPeer).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000


Handler = Callable[[bytes, Any], Awaitable[None]]


def _peer_address(frame: Any) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except Exception:  # noqa: BLE001 - not every transport knows its peer
        return ""


class SideChannelServer:
    """P's ROUTER socket. `handler(identity, message)` runs on the loop for every decoded frame.

    `sealer`: the deployment key's frame sealer (None: frames travel unsealed, as without a key);
    `on_refused(reason)` counts each frame dropped for its seal (unauthenticated, stale, replayed).
    """

    def __init__(
        self, loop: EventLoopThread, host: str, handler: Handler, port: int = 0, *,
        sealer: FrameSealer | None = None, on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self._loop = loop
        self._host = host
        self._handler = handler
        self.sealer = sealer
        self.refusals = RefusalLog(f"side channel on {host}")
        self._on_refused = on_refused
        self.port = 0
        self._sock: Any = None
        self.dropped = 0
        try:
            self.port = loop.submit(self._bind(port)).result(10)
        except Exception as exc:  # noqa: BLE001 - turned into one typed error
            raise StartError(f"side channel cannot listen on {host}: {exc}") from None
        self._task = loop.submit(self._serve())

    @property
    def address(self) -> str:
        return f"tcp://{self._host}:{self.port}"

    async def _bind(self, port: int) -> int:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # Replies to a peer that went away are dropped, never block the loop.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            sock.bind(f"tcp://{self._host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{self._host}")
        self._sock = sock
        return port

    async def send(self, identity: bytes, reply: Any) -> None:
        body = encode(reply)
        if self.sealer is not None:
            body = self.sealer.seal(body, TO_D)
        try:
            await self._sock.send_multipart((identity, body), copy=False)
        except Exception as exc:  # noqa: BLE001 - a vanished peer must not stop the server
            log.warning("side channel: reply to a peer failed: %s", exc)

    async def _serve(self) -> None:
        while True:
            try:
                parts = await self._sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep listening whatever a peer sends
                log.warning("side channel: receive failed: %s", exc)
                await asyncio.sleep(0.01)
                continue
            if len(parts) != 2:
                self.dropped += 1
                log.warning("side channel: dropped a message of %d frames (expected 1)", len(parts) - 1)
                continue
            identity, frame = parts[0].bytes, parts[1].bytes
            if self.sealer is not None:
                body, why = self.sealer.open(frame, TO_P)
                if body is None:
                    self.dropped += 1
                    self.refusals.refused(_peer_address(parts[1]), why)
                    if self._on_refused is not None:
                        self._on_refused(why)
                    continue
                frame = body
            try:
                msg = decode_request(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.dropped += 1
                log.warning("side channel: refused a malformed message (%d bytes): %s", len(frame), exc)
                await self.send(identity, ErrorReply(error=f"malformed message: {exc}"))
                continue
            try:
                await self._handler(identity, msg)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a handler bug answers one peer, not all
                log.exception("side channel: handling %s failed", type(msg).__name__)
                await self.send(identity, ErrorReply(error=f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        async def _close() -> None:
            self._task.cancel()
            if self._sock is not None:
                self._sock.close(linger=0)
            self._ctx.term()

        try:
            self._loop.submit(_close()).result(5)
        except Exception:  # noqa: BLE001 - closing; the loop may already be gone
            pass


class SideChannelPeer:
    """D's DEALER to one P worker. Runs on the loop; `on_reply(msg)` gets every decoded reply.

    `on_lost(address)` runs when an established connection to P ends: P's
    process died (its kernel closes the socket at once), P closed its side
    channel, or ZMQ heartbeats went unanswered for `heartbeat_timeout_ms` (a
    cut link, or a P whose ZMQ thread got no core that long). P keeps no state
    across a reconnect, so every pull in flight to it is lost then; ZMQ
    reconnects by itself for later pulls. `lost` is True from then until a
    connection to P is made again; the warning says how long the connection
    had lived and how long P had been silent, and a reconnection is logged.
    """

    def __init__(
        self, ctx: Any, address: str, on_reply: Callable[[Any], None], on_lost: Callable[[str], None] | None = None, *,
        sealer: FrameSealer | None = None, on_refused: Callable[[str], None] | None = None,
        heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    ) -> None:
        import zmq

        self.address = address
        self.sealer = sealer
        self.refusals = RefusalLog(f"side channel to {address}")
        self._on_refused = on_refused
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout_ms)
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self._on_reply = on_reply
        self._on_lost = on_lost
        self.lost = False
        # monotonic times, owned by the loop: the last connection made and lost, the last frame from P
        self.connected_at = self.lost_at = self.heard_at = 0.0
        loop = asyncio.get_running_loop()
        self._monitor: Any = None
        self._monitor_task: asyncio.Task | None = None
        if on_lost is not None:
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._monitor_task = loop.create_task(self._watch(self._monitor))
        self._sock.connect(address)
        self._task = loop.create_task(self._read())

    async def send(self, msg: Any) -> None:
        body = encode(msg)
        await self._sock.send(self.sealer.seal(body, TO_P) if self.sealer is not None else body, copy=False)

    async def _watch(self, monitor: Any) -> None:
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            now = time.monotonic()
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self.lost:
                    log.warning("side channel: connection to %s made again, %.1f s after it was lost", self.address, now - self.lost_at)
                self.lost, self.connected_at = False, now
                continue
            self.lost, self.lost_at = True, now
            lived = f"{now - self.connected_at:.1f} s after it was made" if self.connected_at else "before a handshake"
            heard = f"{now - self.heard_at:.1f} s after P's last frame" if self.heard_at else "before any frame from P"
            log.warning("side channel: connection to %s lost, %s, %s (P closed it, or its heartbeat went unanswered for "
                        "%g s: P gone, the link cut, or P's or this host's cores too busy to answer)",
                        self.address, lived, heard, self.heartbeat_timeout_ms / 1000)
            assert self._on_lost is not None
            try:
                self._on_lost(self.address)
            except Exception:  # noqa: BLE001
                log.exception("side channel: handling the loss of %s failed (%s)", self.address, event)

    async def _read(self) -> None:
        while True:
            try:
                frame = await self._sock.recv()
                self.heard_at = time.monotonic()
                if self.sealer is not None:
                    body, why = self.sealer.open(frame, TO_D)
                    if body is None:
                        self.refusals.refused(self.address, why)
                        if self._on_refused is not None:
                            self._on_refused(why)
                        continue
                    frame = body
                msg = decode_reply(frame)
            except asyncio.CancelledError:
                raise
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("side channel: dropped a malformed reply from %s: %s", self.address, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - keep reading
                log.warning("side channel: receive from %s failed: %s", self.address, exc)
                await asyncio.sleep(0.01)
                continue
            try:
                self._on_reply(msg)
            except Exception:  # noqa: BLE001
                log.exception("side channel: handling a reply from %s failed", self.address)

    def close(self) -> None:
        self._task.cancel()
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            with contextlib.suppress(Exception):
                self._sock.disable_monitor()
            self._monitor.close(linger=0)  # now: the context's term() waits for every socket
        self._sock.close(linger=0)

"""The side channel's wire (one msgpack message a frame, sealed with the deployment key when one is set) and
its one-shot client, for whoever asks a P worker something from outside the connector: `pdkv trace`, the
proxy, benchmarks.

P's workers serve it (pdkv.connector.side_channel.SideChannelServer); D's
workers keep a connection to each (SideChannelPeer). Here: `request_once`
(one message, one reply), `send_once` (messages that want none) and
`query_stats` (a StatsQuery, its StatsReply or a typed error).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from pdkv.auth import FrameSealer, sealer_from_env
from pdkv.errors import RemoteError, UnreachableError
from pdkv.protocol import SideChannelReply, SideChannelRequest, StatsQuery, StatsReply

_request_decoder = msgspec.msgpack.Decoder(SideChannelRequest)
_reply_decoder = msgspec.msgpack.Decoder(SideChannelReply)
_encoder = msgspec.msgpack.Encoder()

TO_P, TO_D = b"q", b"r"  # the sealed direction of a frame
FROM_ENV: Any = object()  # default of `sealer`: the deployment key from the environment, if set


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: bytes) -> Any:
    """Decode one D->P frame; raises msgspec.DecodeError (bad msgpack) or ValidationError (bad types/bounds)."""
    return _request_decoder.decode(frame)


def decode_reply(frame: bytes) -> Any:
    return _reply_decoder.decode(frame)


def sealer_of(sealer: Any) -> FrameSealer | None:
    """`sealer` itself, or for FROM_ENV the deployment key's sealer from the environment (None without a key)."""
    return sealer_from_env() if sealer is FROM_ENV else sealer


async def request_once(address: str, msg: Any, timeout: float, *, sealer: Any = FROM_ENV) -> Any:
    """Send one message to a P worker and wait for one reply (for stats queries and probes).

    `sealer` defaults to the deployment key in the environment (pdkv.auth); a reply whose seal fails is
    skipped, so the wait may run out (asyncio.TimeoutError)."""
    import zmq
    import zmq.asyncio

    sealer = sealer_of(sealer)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        body = encode(msg)
        await sock.send(sealer.seal(body, TO_P) if sealer is not None else body)
        async with asyncio.timeout(timeout):
            while True:
                frame = await sock.recv()
                if sealer is None:
                    return decode_reply(frame)
                body, _why = sealer.open(frame, TO_D)
                if body is not None:
                    return decode_reply(body)
    finally:
        sock.close(linger=0)
        ctx.term()


def send_once(address: str, msgs: list[Any], linger_ms: int = 500, *, sealer: Any = FROM_ENV) -> None:
    """Send messages that want no reply to a P worker (blocking, at most about `linger_ms`): run it off the loop.
    `sealer` defaults to the deployment key in the environment."""
    import zmq

    sealer = sealer_of(sealer)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(address)
        for msg in msgs:
            body = encode(msg)
            sock.send(sealer.seal(body, TO_P) if sealer is not None else body)
    finally:
        sock.close(linger=linger_ms)
        ctx.term()


async def query_stats(address: str, *, since: float = 0.0, limit: int = 1000, timeout: float = 2.0) -> StatsReply:
    """One P worker's transfer traces since `since` and its metrics. UnreachableError when it does not answer
    within `timeout`; RemoteError when it answers another protocol (vLLM's connector) or another message."""
    try:
        reply = await request_once(address, StatsQuery(since=since, limit=limit), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        raise UnreachableError(f"prefill worker {address} did not answer pdkv's stats query within {timeout:g} s") from None
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise RemoteError(f"prefill worker {address} answers in another protocol: not pdkv's connector "
                          "(vLLM's MooncakeConnector?)") from None
    if not isinstance(reply, StatsReply):
        raise RemoteError(f"prefill worker {address} answered the stats query with {type(reply).__name__}")
    return reply

"""The side channel's wire: the messages between D's and P's workers, their framing, and a one-shot client.

Every frame is one msgpack-encoded tagged Struct, sealed with the deployment key when one is set (pdkv.auth;
TO_P and TO_D name a frame's direction in the seal). D opens with an Announce of its KV regions, then pulls:
P answers a PullRequest with PullReply frames, PENDING heartbeats while it waits for its own request to
finish, then exactly one DONE or ERROR. Decoding is strict (types and bounds checked by msgspec, the bounds
of pdkv.bounds), so a malformed frame never reaches the transfer logic.

The split: this module is the wire, and the client for whoever asks a P worker something from outside the
connector (`pdkv trace`, the proxy, benchmarks): `request_once` (one message, one reply), `send_once`
(messages that want none) and `query_stats` (a StatsQuery, its StatsReply or a typed error). The
connector's long-lived ends, P's server and D's connection to each P worker, are connector behaviour:
pdkv.connector.side_channel (SideChannelServer, SideChannelPeer).
"""

from __future__ import annotations

import asyncio
from enum import IntEnum
from typing import Annotated, Any

import msgspec

from pdkv.auth import FrameSealer, sealer_from_env
from pdkv.bounds import (
    Address,
    Binding,
    BlockCount,
    BlockId,
    Count,
    KvHeads,
    Length,
    Rank,
    RankCount,
    UnixTime,
    WaitSeconds,
    check_span,
)
from pdkv.errors import RemoteError, UnreachableError
from pdkv.wire.bootstrap import EngineId
from pdkv.wire.ipc_export import IpcExport
from pdkv.wire.kv_params import TransferId


class Region(msgspec.Struct, frozen=True, array_like=True):
    """One registered KV region: `num_blocks` blocks of `block_len` bytes each, starting at `base`.

    The one type for a region, in a transport's hands and on the wire alike: one layer's cache, or one of
    its K and V halves. Block `b` occupies [base + b * block_len, base + (b + 1) * block_len).
    """

    base: Address
    block_len: Length
    num_blocks: BlockCount

    def __post_init__(self) -> None:
        check_span("region", self.base, self.block_len * self.num_blocks)

    @property
    def size(self) -> int:
        return self.block_len * self.num_blocks


class Announce(msgspec.Struct, frozen=True, tag="announce", kw_only=True):
    """D -> P, once per connection, before its first pull: the KV regions D registered at `session`. P writes
    only inside the regions the latest announcement for a session names; a pull names blocks only."""

    session: str  # D's transfer-engine address ("host:port"; cma: its process), where P writes
    tp_rank: Rank
    tp_size: RankCount
    regions: list[Region]
    # Protocol ipc: the CUDA IPC handles of `regions`; P opens them once per D process.
    ipc: IpcExport | None = None
    kv_heads: KvHeads = 0  # the model's, all ranks (0: unsaid; P then serves only its TP size): checks.announced_share


class PullRequest(msgspec.Struct, frozen=True, tag="pull", kw_only=True):
    """D -> P: write the prompt blocks of `transfer_id` into these blocks of mine.

    `first_block` is the index, in P's block list for the prompt, of the first
    block D lacks (D's own prefix-cache hit covers the blocks before it), so
    `block_ids[i]` receives P's block `first_block + i`.
    """

    transfer_id: TransferId
    d_req_id: str
    session: str  # which announcement (Announce.session) holds the regions `block_ids` index
    tp_rank: Rank
    tp_size: RankCount
    block_ids: list[BlockId]
    first_block: BlockId = 0
    # The transfer's binding secret, as the proxy gave it to this D (DecodeParams.binding); P holds its SHA-256.
    binding: Binding = ""


class Release(msgspec.Struct, frozen=True, tag="release", kw_only=True):
    """D -> P: D no longer wants this transfer (its request ended); P may free the blocks."""

    transfer_id: TransferId
    d_req_id: str
    reason: str = ""
    binding: Binding = ""  # the transfer's binding secret, as in PullRequest: a release must prove it too
    tp_rank: Rank = 0  # the releasing D rank, of tp_size: where D's TP is larger, several D ranks pull one P rank
    tp_size: RankCount = 1


class TraceReport(msgspec.Struct, frozen=True, tag="trace", kw_only=True):
    """D -> P: D's timestamps for a transfer (unix seconds), so P holds the whole trace."""

    transfer_id: TransferId
    events: dict[str, UnixTime]
    first_step_tokens: Count = 0  # tokens D computed in the request's first step after the KV arrived


class StatsQuery(msgspec.Struct, frozen=True, tag="stats", kw_only=True):
    """Anyone -> P: the transfer traces recorded since `since` (unix seconds) and the metrics text."""

    since: UnixTime = 0.0
    limit: Annotated[int, msgspec.Meta(gt=0, le=100_000)] = 1000


SideChannelRequest = Announce | PullRequest | Release | TraceReport | StatsQuery


class PullStatus(IntEnum):
    PENDING = 0  # P knows of the pull and is still waiting for its request: keep waiting
    DONE = 1  # every block has landed in D's memory
    ERROR = 2  # nothing more will come; `error` says why


class PullReply(msgspec.Struct, frozen=True, tag="reply", kw_only=True, omit_defaults=True):
    """P -> D: the state of one pull."""

    transfer_id: TransferId
    d_req_id: str
    status: PullStatus
    error: str = ""
    bytes: Count = 0
    descriptors: Count = 0
    wait_bound_s: WaitSeconds = 0.0  # how long P still waits before giving up on this pull


class TransferTrace(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Everything known about one transfer, P's and D's events together (unix seconds)."""

    transfer_id: TransferId
    p_req_id: str = ""
    d_req_id: str = ""
    status: str = ""
    error: str = ""
    bytes: Count = 0
    descriptors: Count = 0
    first_step_tokens: Count = 0  # D's first step after the KV arrived: 1 means only the last prompt token
    events: dict[str, UnixTime] = {}
    session: str = ""  # on P: D's transfer-engine address ("host:port") it wrote the KV to
    p_rank: Rank = 0  # on P: the TP rank of the worker that recorded it
    d_rank_bytes: dict[str, Count] = {}  # on P, D's TP larger than P's: bytes written into each D rank ("0", "1", ...)


class StatsReply(msgspec.Struct, frozen=True, tag="stats_reply", kw_only=True):
    engine_id: EngineId
    tp_rank: Rank
    traces: list[TransferTrace]
    metrics: str  # Prometheus text exposition format


class ErrorReply(msgspec.Struct, frozen=True, tag="error", kw_only=True):
    """P -> anyone: the frame could not be understood; `error` says why."""

    error: str


SideChannelReply = PullReply | StatsReply | ErrorReply


# --- framing and the one-shot client ------------------------------------------

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

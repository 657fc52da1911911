"""Everything that crosses a process boundary in pdkv, as msgspec Structs.

In the order of this file (the bounds every decoded number carries live in pdkv.bounds): bootstrap payloads
(wire-compatible with vLLM's MooncakeBootstrapServer); CUDA IPC exports (what D announces to P on one GPU host);
kv_transfer_params, the only protocol between the proxy and a connector; the connector's side-channel messages
between D's and P's workers; the proxy's per-request record.
"""

from __future__ import annotations

import secrets
from enum import IntEnum
from typing import Annotated

import msgspec

EngineId = str
TransferId = str
WorkerAddr = str  # "tcp://host:port", a ZMQ side-channel address

from pdkv.bounds import (  # noqa: F401 - re-exported: the wire types' bounds, named where the messages are
    ADDRESS_LIMIT,
    BLOCK_LIMIT,
    INT64_MAX,
    MAX_N_SEQUENCES,
    MAX_RANK,
    MAX_WAIT_S,
    UNIX_TIME_LIMIT,
    Address,
    Binding,
    BlockCount,
    BlockId,
    Count,
    HttpStatus,
    KvHeads,
    Length,
    Rank,
    RankCount,
    UnixTime,
    WaitSeconds,
    check_span,
)

# --- bootstrap -------------------------------------------------------------
# vLLM's MooncakeBootstrapServer speaks: POST /register (RegisterRequest),
# GET /query (QueryResponse). pdkv adds POST /deregister, GET /health and
# GET /metrics; errors answer {"detail": "<message>"} as FastAPI does.

_PORT_MAX = 65535


def split_worker_addr(addr: str) -> tuple[str, int]:
    """`tcp://host:port` -> (host, port); IPv6 hosts come bracketed (`tcp://[::1]:5555`).

    Raises ValueError with a message naming the address when it is not of that form.
    """
    bad = ValueError(f"addr must be tcp://host:port, got {addr!r}")
    if not isinstance(addr, str) or not addr.startswith("tcp://"):
        raise bad
    hostport = addr[len("tcp://") :]
    if hostport.startswith("["):
        host, sep, rest = hostport[1:].partition("]")
        if not sep or not rest.startswith(":") or not host or ":" not in host:
            raise bad
        port_text = rest[1:]
    else:
        host, sep, port_text = hostport.rpartition(":")
        if not sep or not host or ":" in host:
            raise bad
    if any(c.isspace() or c in "/?#@*[]" for c in host):
        raise bad
    if not port_text.isdigit() or not 1 <= int(port_text) <= _PORT_MAX:
        raise bad
    return host, int(port_text)


class RegisterRequest(msgspec.Struct, frozen=True):
    """POST /register body, as vLLM's MooncakeConnector sends it.

    Decoding rejects a rank outside [0, MAX_RANK) (bools, floats and strings
    too), an empty engine_id and an addr that is not `tcp://host:port`;
    construction checks only the addr.
    """

    engine_id: Annotated[EngineId, msgspec.Meta(min_length=1)]
    dp_rank: Rank
    tp_rank: Rank
    pp_rank: Rank
    addr: WorkerAddr

    def __post_init__(self) -> None:
        split_worker_addr(self.addr)


class DeregisterRequest(msgspec.Struct, frozen=True):
    """POST /deregister body (pdkv only): drop every entry of this engine."""

    engine_id: Annotated[EngineId, msgspec.Meta(min_length=1)]


class RegisterResponse(msgspec.Struct, frozen=True):
    """Answer to a successful POST /register; vLLM only checks the status code.

    `result` is "created", "unchanged" (an identical re-registration) or
    "replaced" (the previous holder was found dead and evicted).
    """

    status: str = "ok"
    result: str = "created"


class DeregisterResponse(msgspec.Struct, frozen=True):
    """Answer to POST /deregister: how many worker addresses were removed (0 is not an error)."""

    status: str
    removed: Count


class EngineEntry(msgspec.Struct):
    """One DP rank's prefill engine: {tp_rank: {pp_rank: addr}} (keys are strings on the wire)."""

    engine_id: EngineId
    worker_addr: dict[str, dict[str, WorkerAddr]]


# GET /query answers {"<dp_rank>": EngineEntry}.
QueryResponse = dict[str, EngineEntry]


class HealthResponse(msgspec.Struct, frozen=True):
    """GET /health: the server answers and how much it holds."""

    status: str
    engines: Count
    workers: Count


class ErrorResponse(msgspec.Struct, frozen=True):
    """Body of every 4xx answer: FastAPI's shape, so vLLM logs the message as it would its own."""

    detail: str


# --- CUDA IPC (intra-node GPU transport) -----------------------------------


class IpcRegion(msgspec.Struct, frozen=True, array_like=True):
    """One exported KV region: `length` bytes at `base` (exporter's address), inside allocation `alloc`."""

    alloc: Count  # index into IpcExport.allocations
    base: Address
    length: Length

    def __post_init__(self) -> None:
        check_span("ipc region", self.base, self.length)


class IpcAllocation(msgspec.Struct, frozen=True, array_like=True):
    handle: bytes  # cudaIpcMemHandle_t of the allocation; empty for one shared as a file descriptor
    base: Address  # allocation base in the exporter's address space
    size: Length
    fd: bool = False  # a CUDA VMM allocation, fetched as a file descriptor from the export's fd_server (fd_share)

    def __post_init__(self) -> None:
        check_span("ipc allocation", self.base, self.size)


class IpcExport(msgspec.Struct, frozen=True):
    """What D sends P once per layout so P can open D's KV regions."""

    host_id: str  # boot id + hostname: IPC works only inside one host (one kernel)
    pid: Annotated[int, msgspec.Meta(gt=0, le=4_194_304)]  # Linux's PID_MAX_LIMIT
    device: Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANK)]  # a CUDA device ordinal
    device_uuid: str
    allocations: list[IpcAllocation]
    regions: list[IpcRegion]
    # The exporting process's start time (pdkv.transport.host.process_start_time): P refuses a pid reused since.
    start_time: Annotated[int, msgspec.Meta(ge=0, le=2**62)]
    fd_server: Annotated[str, msgspec.Meta(max_length=100)] = ""  # abstract Unix socket of the `fd` allocations
    fd_token: Annotated[bytes, msgspec.Meta(max_length=32)] = b""

    def __post_init__(self) -> None:
        if any(a.fd for a in self.allocations) and (not self.fd_server or len(self.fd_token) != 32):
            raise ValueError("ipc allocations shared as file descriptors need fd_server and a 32-byte fd_token")
        # P indexes allocations by region.alloc while it holds opened handles: a bad index must not get there.
        for i, region in enumerate(self.regions):
            if region.alloc >= len(self.allocations):
                raise ValueError(f"ipc regions[{i}].alloc is {region.alloc}, but there are {len(self.allocations)} allocations")


# --- kv_transfer_params (proxy -> connector) --------------------------------


class PrefillParams(msgspec.Struct, frozen=True, kw_only=True):
    """What the proxy puts in P's request: compute, keep the blocks, push them to D."""

    transfer_id: TransferId
    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    # D requests that will pull this KV: the client's `n` (D samples each choice as a request of its own).
    pulls: Annotated[int, msgspec.Meta(ge=1, le=MAX_N_SEQUENCES)] = 1
    # SHA-256 (hex) of the binding secret the proxy gave the chosen D: P serves only pulls that carry the secret.
    decode_binding: Binding = ""


class DecodeParams(msgspec.Struct, frozen=True, kw_only=True):
    """What the proxy puts in D's request: the KV comes from this prefill engine."""

    transfer_id: TransferId
    remote_bootstrap_addr: str
    remote_engine_id: EngineId
    do_remote_decode: bool = False
    do_remote_prefill: bool = True
    # The transfer's binding secret (hex), which this D shows P in its pull (see PrefillParams.decode_binding).
    binding: Binding = ""


def new_transfer_id() -> TransferId:
    """A transfer id no one can guess: 128 random bits. Never derived from what a client sends."""
    return f"xfer-{secrets.token_hex(16)}"


# --- side channel (D's worker <-> P's worker, ZMQ DEALER -> ROUTER) ----------
#
# Every frame is one msgpack-encoded tagged Struct. D opens with a PullRequest; P answers with PullReply frames:
# PENDING heartbeats while it waits for its own request to finish, then exactly one DONE or ERROR. Decoding is
# strict (types and bounds checked by msgspec), so a malformed frame never reaches the transfer logic.


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


# --- proxy -------------------------------------------------------------------


class CompletionFields(msgspec.Struct, frozen=True):
    """The fields of a client's completions body that the proxy itself acts on; the rest pass unread.

    `msgspec.convert(body, CompletionFields)` refuses a `stream` that is not a
    bool and an `n` outside [1, MAX_N_SEQUENCES], naming the field; null means
    unset, as vLLM reads it.
    """

    stream: bool | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N_SEQUENCES)] | None = None


class ProxyTiming(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The proxy's own record of one request, for `pdkv trace`: unix times in seconds.

    Keyed by `request_id` (the client's X-Request-Id, or one the proxy made)
    and `transfer_id`; times stay None until the step happens. `error` names
    the cause when the request failed (see docs/proxy.md); `detail` says what
    happened with the backends' addresses and bodies, which the client is not told.
    """

    request_id: str
    transfer_id: TransferId
    endpoint: str
    stream: bool = False
    prefill_url: str = ""
    prefill_dp_rank: Rank | None = None
    decode_url: str = ""
    received: UnixTime = 0.0
    prefill_dispatched: UnixTime | None = None
    prefill_responded: UnixTime | None = None
    prefill_status: HttpStatus | None = None
    decode_dispatched: UnixTime | None = None
    decode_first_byte: UnixTime | None = None
    last_byte: UnixTime | None = None
    status: HttpStatus | None = None
    error: str | None = None
    detail: str | None = None
    # Why D computed the prompt itself ("no_prefill", or "prefill_failed: <cause>"); None: P/D as usual.
    local_prefill: str | None = None
    # Why the kv-aware policy sent it where it went (pdkv.proxy.kv.policy.Placement.summary); None: another policy.
    route: str | None = None

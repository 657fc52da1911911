"""Everything that crosses a process boundary in pdkv, as msgspec Structs.

Three families:
- bootstrap payloads (wire-compatible with vLLM's MooncakeBootstrapServer);
- kv_transfer_params, the only protocol between the proxy and a connector;
- the connector's side-channel messages between D's and P's workers.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated

import msgspec

EngineId = str
TransferId = str
WorkerAddr = str  # "tcp://host:port", a ZMQ side-channel address

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


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

    Decoding (and construction) rejects negative ranks, an empty engine_id and
    an addr that is not `tcp://host:port`.
    """

    engine_id: Annotated[EngineId, msgspec.Meta(min_length=1)]
    dp_rank: NonNegative
    tp_rank: NonNegative
    pp_rank: NonNegative
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
    removed: int


class EngineEntry(msgspec.Struct):
    """One DP rank's prefill engine: {tp_rank: {pp_rank: addr}} (keys are strings on the wire)."""

    engine_id: EngineId
    worker_addr: dict[str, dict[str, WorkerAddr]]


# GET /query answers {"<dp_rank>": EngineEntry}.
QueryResponse = dict[str, EngineEntry]


class HealthResponse(msgspec.Struct, frozen=True):
    """GET /health: the server answers and how much it holds."""

    status: str
    engines: int
    workers: int


class ErrorResponse(msgspec.Struct, frozen=True):
    """Body of every 4xx answer: FastAPI's shape, so vLLM logs the message as it would its own."""

    detail: str


# --- CUDA IPC (intra-node GPU transport) -----------------------------------


class IpcRegion(msgspec.Struct, frozen=True, array_like=True):
    """One exported KV region: `length` bytes at `base` (exporter's address), inside allocation `alloc`."""

    alloc: int  # index into IpcExport.allocations
    base: int
    length: int


class IpcAllocation(msgspec.Struct, frozen=True, array_like=True):
    handle: bytes  # cudaIpcMemHandle_t of the allocation
    base: int  # allocation base in the exporter's address space
    size: int


class IpcExport(msgspec.Struct, frozen=True):
    """What D sends P once per layout so P can open D's KV regions."""

    host_id: str  # boot id + hostname: IPC works only inside one host (one kernel)
    pid: int
    device: int
    device_uuid: str
    allocations: list[IpcAllocation]
    regions: list[IpcRegion]


# --- kv_transfer_params (proxy -> connector) --------------------------------


class PrefillParams(msgspec.Struct, frozen=True, kw_only=True):
    """What the proxy puts in P's request: compute, keep the blocks, push them to D."""

    transfer_id: TransferId
    do_remote_decode: bool = True
    do_remote_prefill: bool = False


class DecodeParams(msgspec.Struct, frozen=True, kw_only=True):
    """What the proxy puts in D's request: the KV comes from this prefill engine."""

    transfer_id: TransferId
    remote_bootstrap_addr: str
    remote_engine_id: EngineId
    do_remote_decode: bool = False
    do_remote_prefill: bool = True


def transfer_id_for(request_id: str) -> TransferId:
    return f"xfer-{request_id}"


# --- side channel (D's worker <-> P's worker, ZMQ DEALER -> ROUTER) ----------
#
# Every frame is one msgpack-encoded tagged Struct. D opens with a PullRequest;
# P answers with PullReply frames: PENDING heartbeats while it waits for its
# own request to finish, then exactly one DONE or ERROR. Decoding is strict
# (types and bounds checked by msgspec), so a malformed frame never reaches
# the transfer logic.


class RegionSpec(msgspec.Struct, frozen=True, array_like=True):
    """One registered KV region as a peer describes it: block b lies at base + b * block_len."""

    base: NonNegative
    block_len: Annotated[int, msgspec.Meta(gt=0)]
    num_blocks: NonNegative


class PullRequest(msgspec.Struct, frozen=True, tag="pull", kw_only=True):
    """D -> P: write the prompt blocks of `transfer_id` into these blocks of mine.

    `first_block` is the index, in P's block list for the prompt, of the first
    block D lacks (D's own prefix-cache hit covers the blocks before it), so
    `block_ids[i]` receives P's block `first_block + i`.
    """

    transfer_id: TransferId
    d_req_id: str
    session: str  # D's transfer-engine address ("host:port"), where P writes
    tp_rank: NonNegative
    tp_size: Annotated[int, msgspec.Meta(gt=0)]
    regions: list[RegionSpec]
    block_ids: list[NonNegative]
    first_block: NonNegative = 0
    # Protocol ipc: the CUDA IPC handles of `regions`; P opens them once per D process.
    ipc: IpcExport | None = None


class Release(msgspec.Struct, frozen=True, tag="release", kw_only=True):
    """D -> P: D no longer wants this transfer (its request ended); P may free the blocks."""

    transfer_id: TransferId
    d_req_id: str
    reason: str = ""


class TraceReport(msgspec.Struct, frozen=True, tag="trace", kw_only=True):
    """D -> P: D's timestamps for a transfer (unix seconds), so P holds the whole trace."""

    transfer_id: TransferId
    events: dict[str, float]
    first_step_tokens: NonNegative = 0  # tokens D computed in the request's first step after the KV arrived


class StatsQuery(msgspec.Struct, frozen=True, tag="stats", kw_only=True):
    """Anyone -> P: the transfer traces recorded since `since` (unix seconds) and the metrics text."""

    since: float = 0.0
    limit: Annotated[int, msgspec.Meta(gt=0, le=100_000)] = 1000


SideChannelRequest = PullRequest | Release | TraceReport | StatsQuery


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
    bytes: NonNegative = 0
    descriptors: NonNegative = 0
    wait_bound_s: float = 0.0  # how long P still waits before giving up on this pull


class TransferTrace(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Everything known about one transfer, P's and D's events together (unix seconds)."""

    transfer_id: TransferId
    p_req_id: str = ""
    d_req_id: str = ""
    status: str = ""
    error: str = ""
    bytes: NonNegative = 0
    descriptors: NonNegative = 0
    first_step_tokens: NonNegative = 0  # D's first step after the KV arrived: 1 means only the last prompt token
    events: dict[str, float] = {}


class StatsReply(msgspec.Struct, frozen=True, tag="stats_reply", kw_only=True):
    engine_id: EngineId
    tp_rank: NonNegative
    traces: list[TransferTrace]
    metrics: str  # Prometheus text exposition format


class ErrorReply(msgspec.Struct, frozen=True, tag="error", kw_only=True):
    """P -> anyone: the frame could not be understood; `error` says why."""

    error: str


SideChannelReply = PullReply | StatsReply | ErrorReply


# --- proxy -------------------------------------------------------------------


class ProxyTiming(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The proxy's own record of one request, for `pdkv trace`: unix times in seconds.

    Keyed by `request_id` (the client's X-Request-Id, or one the proxy made)
    and `transfer_id`; times stay None until the step happens. `error` names
    the cause when the request failed (see docs/proxy.md).
    """

    request_id: str
    transfer_id: TransferId
    endpoint: str
    stream: bool = False
    prefill_url: str = ""
    prefill_dp_rank: int | None = None
    decode_url: str = ""
    received: float = 0.0
    prefill_dispatched: float | None = None
    prefill_responded: float | None = None
    prefill_status: int | None = None
    decode_dispatched: float | None = None
    decode_first_byte: float | None = None
    last_byte: float | None = None
    status: int | None = None
    error: str | None = None

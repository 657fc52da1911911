"""pdkv's wires, one module each: every message that crosses a process boundary, as msgspec Structs.

- `bootstrap`: the engine registry's messages, wire-compatible with vLLM's MooncakeBootstrapServer;
- `ipc_export`: the CUDA IPC export D announces to P on one GPU host;
- `kv_params`: kv_transfer_params, the only protocol between the proxy and a connector;
- `members`: live membership (pdkv's extension of the bootstrap server): the record each engine keeps leased, and
  the messages of /pdkv/members;
- `side_channel`: the messages between D's and P's workers, their framing and a one-shot client (the
  connector's server and peer are pdkv.connector.side_channel).

The bounds every decoded number carries are pdkv.bounds's. The proxy's own HTTP surface, its per-request
record included, is pdkv.proxy_api.
"""

from pdkv.wire.bootstrap import (
    DeregisterRequest,
    DeregisterResponse,
    EngineEntry,
    EngineId,
    ErrorResponse,
    HealthResponse,
    QueryResponse,
    RegisterRequest,
    RegisterResponse,
    WorkerAddr,
    split_worker_addr,
)
from pdkv.wire.ipc_export import (
    IpcAllocation,
    IpcExport,
    IpcRegion,
)
from pdkv.wire.kv_params import (
    DecodeParams,
    PrefillParams,
    TransferId,
    new_transfer_id,
)
from pdkv.wire.members import (
    DEFAULT_MEMBER_TTL_S,
    LeaveRequest,
    MemberRecord,
    MembersResponse,
    MemberView,
)
from pdkv.wire.side_channel import (
    TO_D,
    TO_P,
    Announce,
    ErrorReply,
    PullReply,
    PullRequest,
    PullStatus,
    Region,
    Release,
    SideChannelReply,
    SideChannelRequest,
    StatsQuery,
    StatsReply,
    TraceReport,
    TransferTrace,
    decode_reply,
    decode_request,
    encode,
    query_stats,
    request_once,
    send_once,
)

__all__ = [
    "Announce",
    "DEFAULT_MEMBER_TTL_S",
    "DecodeParams",
    "DeregisterRequest",
    "DeregisterResponse",
    "EngineEntry",
    "EngineId",
    "ErrorReply",
    "ErrorResponse",
    "HealthResponse",
    "IpcAllocation",
    "IpcExport",
    "IpcRegion",
    "LeaveRequest",
    "MemberRecord",
    "MemberView",
    "MembersResponse",
    "PrefillParams",
    "PullReply",
    "PullRequest",
    "PullStatus",
    "QueryResponse",
    "Region",
    "RegisterRequest",
    "RegisterResponse",
    "Release",
    "SideChannelReply",
    "SideChannelRequest",
    "StatsQuery",
    "StatsReply",
    "TO_D",
    "TO_P",
    "TraceReport",
    "TransferId",
    "TransferTrace",
    "WorkerAddr",
    "decode_reply",
    "decode_request",
    "encode",
    "new_transfer_id",
    "query_stats",
    "request_once",
    "send_once",
    "split_worker_addr",
]

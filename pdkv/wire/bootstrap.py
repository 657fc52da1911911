"""The bootstrap registry's wire, wire-compatible with vLLM's MooncakeBootstrapServer.

vLLM's MooncakeConnector speaks POST /register (RegisterRequest) and GET /query (QueryResponse). pdkv adds
POST /deregister, GET /health and GET /metrics; errors answer {"detail": "<message>"} as FastAPI does. The
server and its client are pdkv.bootstrap; the bounds of every number here are pdkv.bounds's.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from pdkv.bounds import Count, Rank

EngineId = str
WorkerAddr = str  # "tcp://host:port", a ZMQ side-channel address

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

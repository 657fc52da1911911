"""Everything that crosses a process boundary in pdkv, as msgspec Structs.

Three families:
- bootstrap payloads (wire-compatible with vLLM's MooncakeBootstrapServer);
- kv_transfer_params, the only protocol between the proxy and a connector;
- the connector's side-channel messages between D's and P's workers.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

EngineId = str
TransferId = str
WorkerAddr = str  # "tcp://host:port", a ZMQ side-channel address

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


# --- bootstrap -------------------------------------------------------------


class RegisterRequest(msgspec.Struct, frozen=True):
    """POST /register body, as vLLM's MooncakeConnector sends it."""

    engine_id: EngineId
    dp_rank: NonNegative
    tp_rank: NonNegative
    pp_rank: NonNegative
    addr: WorkerAddr


class EngineEntry(msgspec.Struct):
    """One DP rank's prefill engine: {tp_rank: {pp_rank: addr}} (keys are strings on the wire)."""

    engine_id: EngineId
    worker_addr: dict[str, dict[str, WorkerAddr]]


# GET /query answers {"<dp_rank>": EngineEntry}.
QueryResponse = dict[str, EngineEntry]


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

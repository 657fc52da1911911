"""kv_transfer_params: the only protocol between the proxy and a connector.

The proxy puts PrefillParams in P's request and DecodeParams in D's (pdkv.proxy.rewrite); the connector's
scheduler reads them back (pdkv.connector.config). The transfer id minted here names the transfer on every
later wire: the side channel's pulls and traces, the proxy's request record.
"""

from __future__ import annotations

import secrets
from typing import Annotated

import msgspec

from pdkv.bounds import MAX_N_SEQUENCES, Binding
from pdkv.wire.bootstrap import EngineId

TransferId = str

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

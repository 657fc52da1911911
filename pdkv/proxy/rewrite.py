"""The two copies of a client's request the proxy sends: P's and D's (pure).

They follow the kv_transfer_params contract (docs/proxy.md):
- P's copy computes the prompt and exactly one token: max_tokens 1 and
  min_tokens 1, no stream, no stop strings or stop_token_ids. vLLM's
  MooncakeConnector sends KV only when P finishes by length; a stop token or
  string as P's only token would end it "stopped" and leave D waiting.
- D's copy keeps the client's own max_tokens and stream and names the prefill
  engine (bootstrap address, engine id) and the shared transfer id.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdkv.wire import DecodeParams, PrefillParams
from pdkv.proxy.config import KvConnector
from pdkv.proxy.routing import PrefillTarget

# Fields a prefill must not carry: they could end P before its one token is
# "length capped" (stop, stop_token_ids) or ask for a stream P never gives.
_PREFILL_DROPPED = ("stop", "stop_token_ids", "stream_options")


def prefill_request(body: dict[str, Any], transfer_id: str, decode_binding: str = "") -> dict[str, Any]:
    """P's copy of a client's completions body: one token, by length, no stream, no stop conditions.

    `decode_binding` (pdkv's connector only): the commitment to the binding secret only the chosen D gets."""
    p = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["min_tokens"] = 1
    p["stream"] = False
    # One prefill whatever the client's n: D samples the n choices, each one pulling the same KV.
    n = body.get("n") or 1
    p["n"] = 1
    params = msgspec.to_builtins(PrefillParams(transfer_id=transfer_id, pulls=n, decode_binding=decode_binding))
    if n == 1:
        del params["pulls"]  # P's params stay exactly vLLM's contract where there is nothing to add
    if not decode_binding:
        del params["decode_binding"]
    p["kv_transfer_params"] = params
    return p


def unsupported_field(body: dict[str, Any], connector: KvConnector = KvConnector.PDKV) -> str | None:
    """Why this body cannot be served through P/D (naming the field), or None.

    Beam search runs many sequences that grow and fork from the prompt on one
    engine; it cannot be split into one prefill and a decode elsewhere. vLLM's
    MooncakeConnector sends a transfer to one D request only, so the n
    choices of `n > 1` (n D requests) would leave all but one waiting.
    """
    if body.get("use_beam_search"):
        return "use_beam_search is not supported through prefill/decode disaggregation"
    if connector is KvConnector.MOONCAKE and (body.get("n") or 1) > 1:
        return (
            "n > 1 is not supported with vLLM's MooncakeConnector (it sends each prompt's KV to one decode request); "
            "use pdkv's connector"
        )
    return None


def local_request(body: dict[str, Any]) -> dict[str, Any]:
    """D's copy when D computes the prompt itself: the client's request as a plain vLLM request."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def decode_request(body: dict[str, Any], transfer_id: str, target: PrefillTarget, binding: str = "") -> dict[str, Any]:
    """D's copy: the client's own request, told where its KV comes from; `binding`: the transfer's binding
    secret (pdkv's connector only), which D shows P to prove it is the D this transfer is for."""
    d = dict(body)
    params = msgspec.to_builtins(
        DecodeParams(
            transfer_id=transfer_id,
            remote_bootstrap_addr=target.bootstrap_url,
            remote_engine_id=target.engine_id,
            binding=binding,
        )
    )
    if not binding:
        del params["binding"]
    d["kv_transfer_params"] = params
    return d


def prefill_headers(request_id: str, target: PrefillTarget) -> list[tuple[str, str]]:
    headers = [("X-Request-Id", request_id)]
    if target.dp_size > 1:
        headers.append(("X-data-parallel-rank", str(target.dp_rank)))
    return headers

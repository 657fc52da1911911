"""The messages of the proxy's own HTTP surface, one set for its server (pdkv.proxy) and its client (pure).

    GET  /health                              ProxyHealth (200 when a P/D pair is routable, else 503)
    GET  /pdkv/requests[?limit=N&errors=1]    list[ProxyTiming], newest first
    GET  /pdkv/requests/{request_id}          ProxyTiming (request or transfer id); 404 when not in the log
    GET  /pdkv/planner                        PlannerView; 404 when the planner is off
    POST /pdkv/drain                          DrainRequest -> DrainAnswer; 404 when no backend is at the URL
    POST /v1/completions                      the client's body; the proxy reads only its CompletionFields

Fields a message has only sometimes (a decode server has no bootstrap; the planner's view before its first
round) are UNSET, and then absent from the JSON.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from pdkv.bounds import MAX_N_SEQUENCES, HttpStatus, Rank, UnixTime
from pdkv.wire import TransferId

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
MODELS_PATH = "/v1/models"
COMPLETIONS_PATH = "/v1/completions"
REQUESTS_PATH = "/pdkv/requests"
PLANNER_PATH = "/pdkv/planner"
DRAIN_PATH = "/pdkv/drain"
ADMIN_PREFIXES = ("/pdkv/", METRICS_PATH)  # behind the admin key when one is set
API_KEY_ENV = "PDKV_API_KEY"
ADMIN_KEY_ENV = "PDKV_ADMIN_KEY"


class BackendHealth(msgspec.Struct, frozen=True):
    """One backend as GET /health lists it; `bootstrap` and `engines` (DP rank -> engine id) are a prefill's."""

    role: str
    url: str
    up: bool
    reason: str = ""
    bootstrap: str | None | UnsetType = UNSET
    engines: dict[str, str] | UnsetType = UNSET


class ProxyHealth(msgspec.Struct, frozen=True):
    status: str  # "ok" | "unavailable"
    reason: str
    backends: list[BackendHealth] = []
    notes: list[str] = []
    kv_self_checks: dict[str, str] | UnsetType = UNSET  # the kv-aware policy's, by engine

    def of_role(self, role: str) -> list[BackendHealth]:
        return [b for b in self.backends if b.role == role]


class DrainRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    url: str
    draining: bool = True


class DrainAnswer(msgspec.Struct, frozen=True):
    url: str
    role: str
    draining: bool
    in_flight: int  # requests this proxy has in flight on it


class BackendRoute(msgspec.Struct, frozen=True):
    """One backend's routing state, as GET /pdkv/planner lists it."""

    role: str
    url: str
    up: bool
    draining: bool
    in_flight: int


class RoleCounts(msgspec.Struct, frozen=True):
    prefill: int
    decode: int


class LatencyMs(msgspec.Struct, frozen=True):
    ttft: float | None
    itl: float | None


class TargetsMs(msgspec.Struct, frozen=True):
    ttft: float
    itl: float
    quantile: float


class PlannerObservation(msgspec.Struct, frozen=True):
    window_s: float
    rate: float
    requests: int
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    prefill_waiting: float
    prefill_running: float
    ttft_ms: float | None
    itl_ms: float | None


class RoleBounds(msgspec.Struct, frozen=True):
    prefill: list[int]  # [min, max]
    decode: list[int]


class PlannerView(msgspec.Struct, frozen=True):
    """GET /pdkv/planner: the planner's last round (`desired` None before the first) and every backend's state."""

    desired: RoleCounts | None = None
    current: RoleCounts | UnsetType = UNSET
    need: RoleCounts | UnsetType = UNSET
    keep: RoleCounts | UnsetType = UNSET
    binding: str | UnsetType = UNSET
    predicted_ms: LatencyMs | UnsetType = UNSET
    targets_ms: TargetsMs | UnsetType = UNSET
    observation: PlannerObservation | UnsetType = UNSET
    bounds: RoleBounds | UnsetType = UNSET
    rounds: int = 0
    at: float | UnsetType = UNSET
    backends: list[BackendRoute] = []


def error_detail(body: bytes) -> str:
    """The message of an error answer (OpenAI's {"error": {"message"}} or {"detail"}), else its text."""
    try:
        decoded: Any = msgspec.json.decode(body)
    except msgspec.DecodeError:
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "detail" in decoded:
            return str(decoded["detail"])
        if "reason" in decoded:
            return str(decoded["reason"])
    return " ".join(body[:300].decode(errors="replace").split())


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

"""The messages of the proxy's own HTTP surface, one set for its server (pdkv.proxy) and its client (pure).

    GET  /health                              ProxyHealth (200 when a P/D pair is routable, else 503)
    GET  /pdkv/requests[?limit=N&errors=1]    list[ProxyTiming], newest first
    GET  /pdkv/requests/{request_id}          ProxyTiming (request or transfer id); 404 when not in the log
    GET  /pdkv/planner                        PlannerView; 404 when the planner is off
    POST /pdkv/drain                          DrainRequest -> DrainAnswer; 404 when no backend is at the URL

Fields a message has only sometimes (a decode server has no bootstrap; the planner's view before its first
round) are UNSET, and then absent from the JSON.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

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

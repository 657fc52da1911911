"""The proxy's own HTTP surface, shared by its server (pdkv.proxy) and every tool that reads or steers it
(`pdkv up`'s autoscaler and warm-up, `pdkv status`, `pdkv top`, `pdkv trace`).

- `messages`: the routes and their msgspec messages (`ProxyHealth`, `PlannerView`, `DrainRequest`, ...), pure,
  the proxy's per-request record (`ProxyTiming`) and the completions fields it reads (`CompletionFields`) among them;
- `client`: `ProxyClient`, and the headers that carry the admin and API keys.

Importing this package imports httpx and msgspec, not the proxy.
"""

from pdkv.proxy_api.client import ProxyClient, admin_headers, api_headers
from pdkv.proxy_api.messages import (
    ADMIN_KEY_ENV,
    ADMIN_PREFIXES,
    API_KEY_ENV,
    DRAIN_PATH,
    PLANNER_PATH,
    REQUESTS_PATH,
    BackendHealth,
    BackendRoute,
    CompletionFields,
    DrainAnswer,
    DrainRequest,
    LatencyMs,
    PlannerObservation,
    PlannerView,
    ProxyHealth,
    ProxyTiming,
    RoleBounds,
    RoleCounts,
    TargetsMs,
)

__all__ = [
    "ADMIN_KEY_ENV",
    "ADMIN_PREFIXES",
    "API_KEY_ENV",
    "BackendHealth",
    "BackendRoute",
    "CompletionFields",
    "DRAIN_PATH",
    "DrainAnswer",
    "DrainRequest",
    "LatencyMs",
    "PLANNER_PATH",
    "PlannerObservation",
    "PlannerView",
    "ProxyClient",
    "ProxyHealth",
    "ProxyTiming",
    "REQUESTS_PATH",
    "RoleBounds",
    "RoleCounts",
    "TargetsMs",
    "admin_headers",
    "api_headers",
]

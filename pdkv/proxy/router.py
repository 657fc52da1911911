"""The proxy's one routing seam: where a request goes, whatever the policy.

`route()` answers a `Route` (a P/D pair, or D alone with the reason) or None when no pair is up (the app's
no-prefill path decides then); `finished()` hears that the request is over. Round-robin and least-outstanding
(`LoadRouter`: pdkv.proxy.routing's Chooser over the backends' counts) and kv-aware (pdkv.proxy.kv_router's
`KvRouter`) stand behind it; the app never asks which one it has.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from pdkv.proxy_api import ProxyTiming
from pdkv.proxy.backends import Backends, BackendState, PrefillState
from pdkv.proxy.routing import Pairing


class Route(NamedTuple):
    """A P/D pair (`pairing`, `prefill` its server), or D alone (`pairing` None, `local` why) for one request."""

    pairing: Pairing | None
    prefill: PrefillState | None
    decode: BackendState
    local: str | None = None


class Router(Protocol):
    def start(self) -> None:
        """Start what the policy follows (KV events, engines' /metrics); on the proxy's loop."""

    async def route(self, body: dict[str, Any], endpoint: str, t: ProxyTiming) -> Route | None: ...

    def finished(self, t: ProxyTiming) -> None: ...

    def follow(self, engine_url: str, kv_events: str | None, kv_events_replay: str | None) -> None:
        """An engine's KV events learnt at run time (a members-registry record), or gone (`kv_events` None)."""

    def health(self) -> dict[str, Any]:
        """What the policy adds to GET /health."""
        ...

    async def close(self) -> None: ...


class LoadRouter:
    """Round-robin or least-outstanding (the backends' own choosers): no state of its own."""

    def __init__(self, backends: Backends) -> None:
        self.backends = backends

    def start(self) -> None:
        return None

    async def route(self, body: dict[str, Any], endpoint: str, t: ProxyTiming) -> Route | None:
        chosen = self.backends.pair()
        return None if chosen is None else Route(*chosen)

    def finished(self, t: ProxyTiming) -> None:
        return None

    def follow(self, engine_url: str, kv_events: str | None, kv_events_replay: str | None) -> None:
        return None  # this policy reads no KV events

    def health(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        return None


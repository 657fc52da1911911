"""The proxy's Prometheus metrics (through prometheus_client) and its ring buffer of per-request timings.

Histograms (seconds), the TTFT split of one request:
    pdkv_proxy_prefill_seconds        P dispatched -> P's answer
    pdkv_proxy_decode_wait_seconds    P's answer -> D's first byte (transfer + D's first step)
    pdkv_proxy_ttfb_seconds           proxy received -> first byte to the client
    pdkv_proxy_request_seconds        proxy received -> last byte to the client
Counters: pdkv_proxy_requests_total{status}, pdkv_proxy_errors_total{cause},
pdkv_proxy_local_prefill_total{reason} (requests D computed alone: no_prefill, prefill_failed, kv_local:
the kv-aware policy found D holding all but a few of the prompt's tokens; pdkv.proxy.kv.metrics has its other metrics).
Gauges: pdkv_proxy_backend_up{role,url}, pdkv_proxy_outstanding_requests{role,url}.

`observe` runs once per request on the proxy's loop: every labelled child it
touches is made once and kept, so an observation is a few increments.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdkv.metrics import histogram, render
from pdkv.proxy_api import ProxyTiming

ERROR_CAUSES = (
    "bad_request",
    "no_backend",
    "prefill_connect",
    "prefill_timeout",
    "prefill_status",
    "prefill_disconnect",
    "decode_connect",
    "decode_timeout",
    "decode_status",
    "decode_disconnect",
    "client_disconnect",
)


LOCAL_REASONS = ("no_prefill", "prefill_failed")  # kv_local is made on first use (kv-aware only)


class _Children:
    """A labelled metric's children by label value, each made on first use and kept (no lookup per request)."""

    def __init__(self, metric: Any, known: Iterable[str] = ()) -> None:
        self._metric = metric
        self._by_value: dict[str, Any] = {}
        for value in sorted(known):  # shown at 0 from the start
            self[value]

    def __getitem__(self, value: str) -> Any:
        child = self._by_value.get(value)
        if child is None:
            child = self._by_value[value] = self._metric.labels(value)
        return child


class ProxyMetrics:
    """Everything /metrics shows, on its own registry. `observe(timing)` records one finished request."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = _Children(Counter("pdkv_proxy_requests_total", "Requests answered, by HTTP status.", ["status"], registry=r))
        self.errors = _Children(Counter("pdkv_proxy_errors_total", "Failed requests, by cause.", ["cause"], registry=r), ERROR_CAUSES)
        self.local = _Children(
            Counter("pdkv_proxy_local_prefill_total", "Requests decode computed alone, by reason.", ["reason"], registry=r), LOCAL_REASONS
        )
        self.prefill = histogram("pdkv_proxy_prefill_seconds", "P dispatched to P's answer.", r)
        self.decode_wait = histogram("pdkv_proxy_decode_wait_seconds", "P's answer to D's first byte.", r)
        self.ttfb = histogram("pdkv_proxy_ttfb_seconds", "Proxy received to first byte sent to the client.", r)
        self.total = histogram("pdkv_proxy_request_seconds", "Proxy received to last byte sent to the client.", r)
        self._backend_up = Gauge("pdkv_proxy_backend_up", "1 if the backend passes health checks.", ["role", "url"], registry=r)
        self._outstanding = Gauge("pdkv_proxy_outstanding_requests", "Requests in flight per backend.", ["role", "url"], registry=r)

    def observe(self, t: ProxyTiming) -> None:
        self.requests[str(t.status or 0)].inc()
        if t.error:
            self.errors[t.error].inc()
        if t.local_prefill:
            self.local[t.local_prefill.partition(":")[0]].inc()
        if t.prefill_responded is not None and t.prefill_dispatched is not None:
            self.prefill.observe(t.prefill_responded - t.prefill_dispatched)
            if t.decode_first_byte is not None:
                self.decode_wait.observe(max(0.0, t.decode_first_byte - t.prefill_responded))
        if t.decode_first_byte is not None and not t.error:
            self.ttfb.observe(t.decode_first_byte - t.received)
        if t.last_byte is not None and not t.error:
            self.total.observe(t.last_byte - t.received)

    def render(self, backends: Iterable[tuple[str, str, bool, int]]) -> str:
        """Prometheus text; `backends` yields (role, url, up, outstanding), the backends there are now."""
        # Set on the loop that also observes, so nothing runs between the clear and the render.
        self._backend_up.clear()
        self._outstanding.clear()
        for role, url, up, outstanding in backends:
            self._backend_up.labels(role, url).set(int(up))
            self._outstanding.labels(role, url).set(outstanding)
        return render(self.registry)


class TimingLog:
    """The last `capacity` requests' timings, by request id (the client's correlation id) and by transfer id,
    oldest dropped first. Owned by the proxy's event loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._items: collections.OrderedDict[str, ProxyTiming] = collections.OrderedDict()
        self._by_transfer: dict[str, ProxyTiming] = {}

    def add(self, t: ProxyTiming) -> bool:
        """Record `t`; False (and nothing recorded) if its transfer id is already in the log."""
        if t.transfer_id in self._by_transfer:
            return False
        items = self._items
        old = items.pop(t.request_id, None)  # a client reusing its request id: the newer request keeps the name
        if old is not None:
            self._by_transfer.pop(old.transfer_id, None)
        items[t.request_id] = t
        self._by_transfer[t.transfer_id] = t
        if len(items) > self.capacity:
            _, dropped = items.popitem(last=False)
            self._by_transfer.pop(dropped.transfer_id, None)
        return True

    def get(self, key: str) -> ProxyTiming | None:
        """By request id, or by transfer id."""
        return self._items.get(key) or self._by_transfer.get(key)

    def query(self, query: str) -> list[ProxyTiming]:
        """GET /pdkv/requests?limit=N&errors=1: the newest records (at most the capacity), errors only if asked."""
        params = dict(p.partition("=")[::2] for p in query.split("&") if p)
        try:
            limit = max(1, min(int(params.get("limit", "100")), self.capacity))
        except ValueError:
            limit = 100
        errors_only = params.get("errors") in ("1", "true")
        return self.recent(limit, (lambda t: t.error is not None) if errors_only else None)

    def recent(self, limit: int, keep: Callable[[ProxyTiming], bool] | None = None) -> list[ProxyTiming]:
        """Newest first."""
        out: list[ProxyTiming] = []
        for t in reversed(self._items.values()):
            if keep is None or keep(t):
                out.append(t)
                if len(out) >= limit:
                    break
        return out

    def __len__(self) -> int:
        return len(self._items)

"""The proxy's Prometheus metrics and its ring buffer of per-request timings.

Hand-rolled rather than prometheus_client: an observation is a bisect and two
additions, which matters at thousands of requests per second on one core.

Histograms (seconds), the TTFT split of one request:
    pdkv_proxy_prefill_seconds        P dispatched -> P's answer
    pdkv_proxy_decode_wait_seconds    P's answer -> D's first byte (transfer + D's first step)
    pdkv_proxy_ttfb_seconds           proxy received -> first byte to the client
    pdkv_proxy_request_seconds        proxy received -> last byte to the client
Counters: pdkv_proxy_requests_total{status}, pdkv_proxy_errors_total{cause},
pdkv_proxy_local_prefill_total{reason} (requests D computed alone: no_prefill, prefill_failed).
Gauges: pdkv_proxy_backend_up{role,url}, pdkv_proxy_outstanding{role,url}.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterable

from pdkv.protocol import ProxyTiming

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

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


LOCAL_REASONS = ("no_prefill", "prefill_failed")


class Histogram:
    __slots__ = ("name", "help", "counts", "sum", "count")

    def __init__(self, name: str, help_: str) -> None:
        self.name = name
        self.help = help_
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        running = 0
        for bound, n in zip(BUCKETS, self.counts):
            running += n
            yield f'{self.name}_bucket{{le="{bound:g}"}} {running}'
        yield f'{self.name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{self.name}_sum {self.sum:.6f}"
        yield f"{self.name}_count {self.count}"


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{{{inner}}}"


class ProxyMetrics:
    """Everything /metrics shows. `observe(timing)` records one finished request."""

    def __init__(self) -> None:
        self.prefill = Histogram("pdkv_proxy_prefill_seconds", "P dispatched to P's answer.")
        self.decode_wait = Histogram("pdkv_proxy_decode_wait_seconds", "P's answer to D's first byte.")
        self.ttfb = Histogram("pdkv_proxy_ttfb_seconds", "Proxy received to first byte sent to the client.")
        self.total = Histogram("pdkv_proxy_request_seconds", "Proxy received to last byte sent to the client.")
        self.requests: collections.Counter[int] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter({c: 0 for c in ERROR_CAUSES})
        self.local: collections.Counter[str] = collections.Counter({r: 0 for r in LOCAL_REASONS})

    def observe(self, t: ProxyTiming) -> None:
        self.requests[t.status or 0] += 1
        if t.error:
            self.errors[t.error] += 1
        if t.local_prefill:
            self.local[t.local_prefill.partition(":")[0]] += 1
        if t.prefill_responded is not None and t.prefill_dispatched is not None:
            self.prefill.observe(t.prefill_responded - t.prefill_dispatched)
            if t.decode_first_byte is not None:
                self.decode_wait.observe(max(0.0, t.decode_first_byte - t.prefill_responded))
        if t.decode_first_byte is not None and not t.error:
            self.ttfb.observe(t.decode_first_byte - t.received)
        if t.last_byte is not None and not t.error:
            self.total.observe(t.last_byte - t.received)

    def render(self, backends: Iterable[tuple[str, str, bool, int]]) -> str:
        """Prometheus text; `backends` yields (role, url, up, outstanding)."""
        out: list[str] = []
        out += ["# HELP pdkv_proxy_requests_total Requests answered, by HTTP status.", "# TYPE pdkv_proxy_requests_total counter"]
        out += [f"pdkv_proxy_requests_total{_labels(status=str(s))} {n}" for s, n in sorted(self.requests.items())]
        out += ["# HELP pdkv_proxy_errors_total Failed requests, by cause.", "# TYPE pdkv_proxy_errors_total counter"]
        out += [f"pdkv_proxy_errors_total{_labels(cause=c)} {n}" for c, n in sorted(self.errors.items())]
        out += ["# HELP pdkv_proxy_local_prefill_total Requests decode computed alone, by reason.",
                "# TYPE pdkv_proxy_local_prefill_total counter"]
        out += [f"pdkv_proxy_local_prefill_total{_labels(reason=r)} {n}" for r, n in sorted(self.local.items())]
        for h in (self.prefill, self.decode_wait, self.ttfb, self.total):
            out += h.render()
        rows = list(backends)
        out += ["# HELP pdkv_proxy_backend_up 1 if the backend passes health checks.", "# TYPE pdkv_proxy_backend_up gauge"]
        out += [f"pdkv_proxy_backend_up{_labels(role=r, url=u)} {int(up)}" for r, u, up, _ in rows]
        out += ["# HELP pdkv_proxy_outstanding Requests in flight per backend.", "# TYPE pdkv_proxy_outstanding gauge"]
        out += [f"pdkv_proxy_outstanding{_labels(role=r, url=u)} {n}" for r, u, _, n in rows]
        return "\n".join(out) + "\n"


class TimingLog:
    """The last `capacity` requests' timings, by request id, oldest dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._items: collections.OrderedDict[str, ProxyTiming] = collections.OrderedDict()

    def add(self, t: ProxyTiming) -> None:
        items = self._items
        items[t.request_id] = t
        items.move_to_end(t.request_id)
        if len(items) > self.capacity:
            items.popitem(last=False)

    def get(self, key: str) -> ProxyTiming | None:
        """By request id, or by transfer id (`xfer-<request id>`)."""
        t = self._items.get(key)
        if t is None and key.startswith("xfer-"):
            t = self._items.get(key[5:])
        return t

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

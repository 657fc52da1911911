"""What `pdkv top` and `pdkv up`'s console show, made from two readings of a deployment (pure).

A `Reading` is what one poll saw: the proxy's /health and /metrics and each
engine's /metrics, counters and histograms as they were. `view(before, now)`
turns two readings into a `TopView`: rates over the time between them,
latency quantiles of the histogram observations made between them (as
Prometheus' `histogram_quantile` over `rate`), and gauges as they are now.
"""

from __future__ import annotations

import math

import msgspec

# P's transfers that did not reach D: a failed write, blocks freed unsent, a pull for a transfer P never saw.
TRANSFER_FAILURES = ("failed", "expired", "unknown")


class Histogram(msgspec.Struct, frozen=True):
    """Cumulative bucket counts by upper bound (+Inf last), as exposed."""

    buckets: list[tuple[float, float]] = []

    def minus(self, before: Histogram | None) -> Histogram:
        if before is None:
            return self
        old = dict(before.buckets)
        return Histogram([(le, max(0.0, n - old.get(le, 0.0))) for le, n in self.buckets])

    def quantile(self, q: float) -> float | None:
        """The q-quantile by linear interpolation within its bucket (as Prometheus does); None without observations."""
        if not self.buckets or self.buckets[-1][1] <= 0:
            return None
        rank = q * self.buckets[-1][1]
        lower, below = 0.0, 0.0
        for le, n in self.buckets:
            if n >= rank:
                if math.isinf(le):
                    return lower  # in the open bucket: its lower bound, as Prometheus answers
                return lower + (le - lower) * ((rank - below) / (n - below) if n > below else 1.0)
            lower, below = le, n
        return lower


def add_histograms(a: Histogram, b: Histogram) -> Histogram:
    if not a.buckets:
        return b
    other = dict(b.buckets)
    return Histogram([(le, n + other.get(le, 0.0)) for le, n in a.buckets])


class EngineReading(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    url: str
    up: bool
    reason: str = ""
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    waiting_for_kv: float = 0.0  # D: requests whose KV has not come yet (vLLM's async KV load stages)
    itl: Histogram = Histogram()
    transfers: dict[str, float] = {}  # pdkv's connector, by outcome
    kv_bytes: float = 0.0


class Reading(msgspec.Struct, frozen=True, kw_only=True):
    at: float  # time.monotonic() of the poll
    wall: float  # time.time() of the poll
    proxy_url: str
    proxy_up: bool
    proxy_reason: str = ""
    proxy_metrics: bool = False  # its /metrics was read: without it there are no figures, not figures of 0
    requests: float = 0.0
    errors: dict[str, float] = {}
    local_prefill: dict[str, float] = {}
    ttft: Histogram = Histogram()
    desired: dict[str, float] = {}  # the planner's gauges, by role (empty: the planner is off)
    current: dict[str, float] = {}
    engines: list[EngineReading] = []


class EngineView(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    role: str
    url: str
    up: bool
    reason: str
    running: int
    waiting: int
    kv_usage: float
    waiting_for_kv: int


class Serving(msgspec.Struct, frozen=True, kw_only=True):
    requests_per_s: float | None
    requests: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    errors: int
    errors_per_s: float | None
    errors_by_cause: dict[str, int]
    local_fallbacks: int
    local_fallbacks_per_s: float | None


class Transfers(msgspec.Struct, frozen=True, kw_only=True):
    per_s: float | None
    bytes_per_s: float | None
    sent: int
    failures: int
    recomputes: int  # D's pulls whose KV did not come: recomputed on D


class Planner(msgspec.Struct, frozen=True, kw_only=True):
    desired: dict[str, int]
    current: dict[str, int]


class TopView(msgspec.Struct, frozen=True, kw_only=True):
    at: float  # unix time of the newer reading
    window_s: float | None  # between the two readings; None from one reading (no rates)
    proxy_url: str
    proxy_up: bool
    proxy_reason: str
    engines: list[EngineView]
    serving: Serving
    transfers: Transfers
    planner: Planner | None

    @property
    def ok(self) -> bool:
        return self.proxy_up and all(e.up for e in self.engines)


def _rate(now: float, before: float | None, window: float | None) -> float | None:
    if before is None or not window:
        return None
    return round(max(0.0, now - before) / window, 3)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


class _Handover(msgspec.Struct, frozen=True):
    concluded: float  # every transfer P concluded, whatever its outcome
    sent: float
    failures: float
    recomputes: float
    kv_bytes: float


def _handover(engines: list[EngineReading]) -> _Handover:
    prefills = [e for e in engines if e.role == "prefill"]
    return _Handover(
        concluded=sum(sum(e.transfers.values()) for e in prefills),
        sent=sum(e.transfers.get("sent", 0.0) for e in prefills),
        failures=sum(e.transfers.get(o, 0.0) for e in prefills for o in TRANSFER_FAILURES),
        recomputes=sum(e.transfers.get("failed", 0.0) for e in engines if e.role == "decode"),
        kv_bytes=sum(e.kv_bytes for e in prefills),
    )


def _itl(engines: list[EngineReading]) -> Histogram:
    out = Histogram()
    for e in engines:
        if e.role == "decode":
            out = add_histograms(out, e.itl)
    return out


def view(before: Reading | None, now: Reading) -> TopView:
    """The view of `now`, with rates and quantiles over the time since `before` (None: since the parts started)."""
    read = before is not None and before.proxy_metrics and now.proxy_metrics
    window = (now.at - before.at) if before is not None and read and now.at > before.at else None
    prev = before if window else None
    counts: dict[str, int] = {}
    engines = []
    for e in now.engines:
        counts[e.role] = counts.get(e.role, -1) + 1
        engines.append(EngineView(name=f"{e.role}-{counts[e.role]}", role=e.role, url=e.url, up=e.up, reason=e.reason,
                                  running=int(e.running), waiting=int(e.waiting), kv_usage=round(e.kv_usage, 4),
                                  waiting_for_kv=int(e.waiting_for_kv)))  # fmt: skip
    ttft = now.ttft.minus(prev.ttft if prev else None)
    itl = _itl(now.engines).minus(_itl(prev.engines) if prev else None)
    errors, local = sum(now.errors.values()), sum(now.local_prefill.values())
    serving = Serving(
        requests_per_s=_rate(now.requests, prev.requests if prev else None, window), requests=int(now.requests),
        ttft_p50_ms=_ms(ttft.quantile(0.5)), ttft_p90_ms=_ms(ttft.quantile(0.9)),
        itl_p50_ms=_ms(itl.quantile(0.5)), itl_p90_ms=_ms(itl.quantile(0.9)),
        errors=int(errors), errors_per_s=_rate(errors, sum(prev.errors.values()) if prev else None, window),
        errors_by_cause={c: int(n) for c, n in sorted(now.errors.items()) if n},
        local_fallbacks=int(local), local_fallbacks_per_s=_rate(local, sum(prev.local_prefill.values()) if prev else None, window),
    )
    h, old = _handover(now.engines), _handover(prev.engines) if prev else None
    transfers = Transfers(per_s=_rate(h.concluded, old.concluded if old else None, window),
                          bytes_per_s=_rate(h.kv_bytes, old.kv_bytes if old else None, window),
                          sent=int(h.sent), failures=int(h.failures), recomputes=int(h.recomputes))  # fmt: skip
    planner = None
    if now.desired:
        planner = Planner(desired={r: int(n) for r, n in sorted(now.desired.items())},
                          current={r: int(n) for r, n in sorted(now.current.items())})  # fmt: skip
    return TopView(at=now.wall, window_s=round(window, 3) if window else None, proxy_url=now.proxy_url, proxy_up=now.proxy_up,
                   proxy_reason=now.proxy_reason, engines=engines, serving=serving, transfers=transfers, planner=planner)  # fmt: skip

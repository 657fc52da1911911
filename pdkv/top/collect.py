"""Reading a running deployment for `pdkv top` and `pdkv up`'s console: the proxy's /health and /metrics, and
each engine's /metrics (vLLM's figures and pdkv's connector's), one GET each per poll.

The proxy's /health names the engines; its /metrics carries the request counters, the TTFT histogram and
the planner's gauges. Nothing here writes or asks the proxy for more than a scrape would.
"""

from __future__ import annotations

import time
from typing import Any, Self

from pdkv.engine_api import EngineClient, EngineMetrics
from pdkv.errors import RemoteError, UnreachableError
from pdkv.metrics import Exposition
from pdkv.proxy_api import BackendHealth, ProxyClient, ProxyHealth
from pdkv.top.model import EngineReading, Histogram, Reading


def proxy_figures(scrape: Exposition) -> dict[str, Any]:
    """The Reading fields the proxy's /metrics gives."""
    return {
        "requests": scrape.total("pdkv_proxy_requests_total"),
        "errors": scrape.by_label("pdkv_proxy_errors_total", "cause"),
        "local_prefill": scrape.by_label("pdkv_proxy_local_prefill_total", "reason"),
        "desired": scrape.by_label("pdkv_planner_desired_engines", "role"),
        "current": scrape.by_label("pdkv_planner_current_engines", "role"),
        "ttft": Histogram(scrape.buckets("pdkv_proxy_ttfb_seconds_bucket")),
    }


def engine_figures(scrape: EngineMetrics) -> dict[str, Any]:
    """The EngineReading fields an engine's /metrics gives (vLLM's gauges and histograms, pdkv's connector counters)."""
    return {
        "running": scrape.total("vllm:num_requests_running"),
        "waiting": scrape.total("vllm:num_requests_waiting"),
        "kv_usage": scrape.highest("vllm:kv_cache_usage_perc"),
        "waiting_for_kv": scrape.total("vllm:num_requests_kv_fetch_by_stage"),
        "transfers": scrape.by_label("pdkv_connector_transfers_total", "outcome"),
        "kv_bytes": scrape.total("pdkv_connector_bytes_total"),
        "itl": Histogram(scrape.buckets("vllm:inter_token_latency_seconds_bucket")),
    }


class DeploymentReader:
    """Polls one deployment through its proxy. `read()` -> a Reading; use as a context manager (one HTTP client)."""

    def __init__(self, proxy_url: str, *, timeout: float = 2.0, admin_key: str | None = None) -> None:
        self.proxy = ProxyClient(proxy_url, timeout=timeout, admin_key=admin_key)
        self.proxy_url = self.proxy.url
        self.timeout = timeout
        self._engines: dict[str, EngineClient] = {}  # by URL, kept from poll to poll (their connections with them)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.proxy.close()
        for engine in self._engines.values():
            engine.close()

    def read(self) -> Reading:
        at, wall = time.monotonic(), time.time()
        health: ProxyHealth | None = None
        try:
            health = self.proxy.health()
            reason = "" if health.status == "ok" else health.reason or "not ready"
        except (UnreachableError, RemoteError) as exc:
            reason = exc.message
        figures: dict[str, Any] = {}
        if health is not None:
            try:
                figures = {**proxy_figures(self.proxy.metrics()), "proxy_metrics": True}
            except (UnreachableError, RemoteError):
                figures = {}
        engines = [self._engine(b) for b in health.backends] if health is not None else []
        return Reading(at=at, wall=wall, proxy_url=self.proxy_url, proxy_up=health is not None and health.status == "ok",
                       proxy_reason=reason, engines=engines, **figures)  # fmt: skip

    def _engine(self, backend: BackendHealth) -> EngineReading:
        role, url = backend.role, backend.url.rstrip("/")
        reason = "" if backend.up else backend.reason or "down"
        try:
            if url not in self._engines:
                self._engines[url] = EngineClient(url, timeout=self.timeout)
            scrape = self._engines[url].metrics()
        except (UnreachableError, RemoteError) as exc:
            return EngineReading(role=role, url=url, up=False, reason=reason or exc.message)
        return EngineReading(role=role, url=url, up=backend.up, reason=reason, **engine_figures(scrape))

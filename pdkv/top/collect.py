"""Reading a running deployment for `pdkv top` and `pdkv up`'s console: the proxy's /health and /metrics, and
each engine's /metrics (vLLM's figures and pdkv's connector's), one GET each per poll.

The proxy's /health names the engines; its /metrics carries the request counters, the TTFT histogram and
the planner's gauges. Nothing here writes or asks the proxy for more than a scrape would.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any, Self

from pdkv.deploy.status import parse_prometheus
from pdkv.top.model import EngineReading, Histogram, Reading

Sample = tuple[str, dict[str, str], float]


def _buckets(samples: Iterable[Sample], name: str) -> Histogram:
    by_le: dict[float, float] = {}
    for n, labels, value in samples:
        if n == name and "le" in labels:
            le = math.inf if labels["le"] in ("+Inf", "inf") else float(labels["le"])
            by_le[le] = by_le.get(le, 0.0) + value  # summed over label sets (engines, roles)
    return Histogram(sorted(by_le.items()))


def proxy_figures(text: str) -> dict[str, Any]:
    """The Reading fields the proxy's /metrics gives."""
    samples = parse_prometheus(text)
    out: dict[str, Any] = {"requests": 0.0, "errors": {}, "local_prefill": {}, "desired": {}, "current": {}}
    for name, labels, value in samples:
        if name == "pdkv_proxy_requests_total":
            out["requests"] += value
        elif name == "pdkv_proxy_errors_total":
            out["errors"][labels.get("cause", "?")] = value
        elif name == "pdkv_proxy_local_prefill_total":
            out["local_prefill"][labels.get("reason", "?")] = value
        elif name == "pdkv_planner_desired_engines":
            out["desired"][labels.get("role", "?")] = value
        elif name == "pdkv_planner_current_engines":
            out["current"][labels.get("role", "?")] = value
    out["ttft"] = _buckets(samples, "pdkv_proxy_ttfb_seconds_bucket")
    return out


def engine_figures(text: str) -> dict[str, Any]:
    """The EngineReading fields an engine's /metrics gives (vLLM's gauges and histograms, pdkv's connector counters)."""
    samples = parse_prometheus(text)
    out: dict[str, Any] = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "waiting_for_kv": 0.0, "transfers": {}, "kv_bytes": 0.0}
    for name, labels, value in samples:
        if name == "vllm:num_requests_running":
            out["running"] += value
        elif name == "vllm:num_requests_waiting":
            out["waiting"] += value
        elif name == "vllm:kv_cache_usage_perc":
            out["kv_usage"] = max(out["kv_usage"], value)
        elif name == "vllm:num_requests_kv_fetch_by_stage":
            out["waiting_for_kv"] += value
        elif name == "pdkv_connector_transfers_total":
            outcome = labels.get("outcome", "?")
            out["transfers"][outcome] = out["transfers"].get(outcome, 0.0) + value
        elif name == "pdkv_connector_bytes_total":
            out["kv_bytes"] += value
    out["itl"] = _buckets(samples, "vllm:inter_token_latency_seconds_bucket")
    return out


class DeploymentReader:
    """Polls one deployment through its proxy. `read()` -> a Reading; use as a context manager (one HTTP client)."""

    def __init__(self, proxy_url: str, *, timeout: float = 2.0, admin_key: str | None = None) -> None:
        import httpx

        from pdkv.proxy.guard import admin_headers

        self.proxy_url = proxy_url.rstrip("/")
        self._admin = admin_headers(admin_key)
        self._client = httpx.Client(timeout=timeout, trust_env=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def _get(self, url: str, headers: dict[str, str] | None = None) -> tuple[int | None, str, str]:
        import httpx

        try:
            r = self._client.get(url, headers=headers)
        except httpx.HTTPError as exc:
            return None, "", f"unreachable ({type(exc).__name__})"
        return r.status_code, r.text, ""

    def read(self) -> Reading:
        import msgspec

        at, wall = time.monotonic(), time.time()
        status, body, err = self._get(f"{self.proxy_url}/health")
        health: dict[str, Any] = {}
        if status is not None:
            try:
                health = msgspec.json.decode(body) if body else {}
            except msgspec.DecodeError:
                health = {}
        reason = err or ("" if status == 200 else str(health.get("reason") or f"answered {status}"))
        figures: dict[str, Any] = {}
        if status is not None:
            m_status, text, _ = self._get(f"{self.proxy_url}/metrics", self._admin)
            figures = {**proxy_figures(text), "proxy_metrics": True} if m_status == 200 else {}
        engines = [self._engine(b) for b in health.get("backends", []) if isinstance(b, dict)]
        return Reading(at=at, wall=wall, proxy_url=self.proxy_url, proxy_up=status == 200, proxy_reason=reason, engines=engines,
                       **figures)  # fmt: skip

    def _engine(self, backend: dict[str, Any]) -> EngineReading:
        role, url = str(backend.get("role", "?")), str(backend.get("url", "")).rstrip("/")
        up = bool(backend.get("up"))
        reason = "" if up else str(backend.get("reason") or "down")
        status, text, err = self._get(f"{url}/metrics")
        if status != 200:
            return EngineReading(role=role, url=url, up=False, reason=reason or err or f"/metrics answered {status}")
        return EngineReading(role=role, url=url, up=up, reason=reason, **engine_figures(text))

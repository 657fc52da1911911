"""Prometheus exposition for the proxy, the bootstrap server and the connector, through prometheus_client.

Each object that renders metrics owns one `CollectorRegistry`, never the
global one: a test process holds several proxies, bootstraps and senders at
once, and the connector runs inside vLLM, which exports its own metrics
through the global registry. Every histogram uses BUCKETS_S.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Histogram, generate_latest

# Sub-millisecond loopback writes to the proxy's two-minute prefill bound: one tuple for every histogram.
BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# generate_latest writes the classic text format; said explicitly, as every pdkv /metrics always has.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def histogram(name: str, documentation: str, registry: CollectorRegistry, labelnames: Sequence[str] = ()) -> Histogram:
    """A histogram in seconds on `registry`, with BUCKETS_S."""
    return Histogram(name, documentation, labelnames, registry=registry, buckets=BUCKETS_S)


def render(registry: CollectorRegistry) -> str:
    """`registry` in the Prometheus text exposition format."""
    return generate_latest(registry).decode()

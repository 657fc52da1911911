"""Prometheus exposition for the proxy, the bootstrap server and the connector, through prometheus_client.

Each object that renders metrics owns one `CollectorRegistry`, never the
global one: a test process holds several proxies, bootstraps and senders at
once, and the connector runs inside vLLM, which exports its own metrics
through the global registry. Every histogram uses BUCKETS_S.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Self

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


Sample = tuple[str, dict[str, str], float]  # (sample name, labels, value)


def _sample_name(line: str) -> str:
    end = len(line)
    for stop in ("{", " "):
        i = line.find(stop)
        if 0 <= i < end:
            end = i
    return line[:end]


def read_samples(text: str | bytes, names: Collection[str] | None = None) -> list[Sample]:
    """(name, labels, value) of every sample in Prometheus text exposition, by prometheus_client's parser:
    the one reader of every /metrics pdkv scrapes (a vLLM engine's, the proxy's).

    With `names`, only samples of those names (as exposed: `x_total`, `x_bucket`) are parsed: an engine's
    /metrics is tens of kilobytes of histograms, and the proxy reads a few gauges of it every second. Each
    sample line is parsed on its own, so one the parser cannot read is skipped and the rest are kept.
    """
    from prometheus_client.parser import text_string_to_metric_families

    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    wanted = None if names is None else frozenset(names)
    out: list[Sample] = []
    for line in text.splitlines():
        if not line or line.startswith("#") or (wanted is not None and _sample_name(line) not in wanted):
            continue
        try:
            for family in text_string_to_metric_families(line):
                out.extend((s.name, dict(s.labels), float(s.value)) for s in family.samples)
        except ValueError:
            continue
    return out


class Exposition:
    """One scrape of a /metrics: its samples, asked by name. A value that is not a finite number of at least 0
    is no reading (no counter or gauge pdkv reads is) and is left out."""

    __slots__ = ("samples",)

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples

    @classmethod
    def parse(cls, text: str | bytes, names: Collection[str] | None = None) -> Self:
        """The samples of `text` (only those of `names`, when given) whose value is a finite number >= 0."""
        return cls([s for s in read_samples(text, names) if math.isfinite(s[2]) and s[2] >= 0])

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)

    def total(self, name: str) -> float:
        """The sum of `name` over every label set (engine cores, models)."""
        return sum(v for n, _, v in self.samples if n == name)

    def highest(self, name: str) -> float:
        """The largest value of `name` (0 without one)."""
        return max((v for n, _, v in self.samples if n == name), default=0.0)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """The sums of `name` by the value of its label `label` ("?" where it has none)."""
        out: dict[str, float] = {}
        for n, labels, v in self.samples:
            if n == name:
                key = labels.get(label, "?")
                out[key] = out.get(key, 0.0) + v
        return out

    def labels(self, name: str) -> list[dict[str, str]]:
        """The label sets of `name`'s samples (an info metric's content)."""
        return [labels for n, labels, _ in self.samples if n == name]

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """A histogram's cumulative bucket counts (`name` is its `_bucket` series) by upper bound, summed over
        label sets, sorted (+Inf last)."""
        by_le: dict[float, float] = {}
        for n, labels, v in self.samples:
            if n == name and "le" in labels:
                le = math.inf if labels["le"] in ("+Inf", "inf") else float(labels["le"])
                by_le[le] = by_le.get(le, 0.0) + v
        return sorted(by_le.items())

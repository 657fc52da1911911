"""What a vLLM engine's /metrics says, read once (pdkv.metrics.read_samples) and asked by name (pure).

vLLM exports, per engine core (label `engine`, one per DP rank), among others:

    vllm:num_requests_running        gauge    requests in its running batch
    vllm:num_requests_waiting        gauge    requests queued for it
    vllm:kv_cache_usage_perc         gauge    0..1 of its KV blocks in use
    vllm:prefix_cache_queries_total  counter  prompt tokens looked up in its prefix cache
    vllm:prefix_cache_hits_total     counter  of those, tokens found there

Samples of several engine cores add up, but KV usage is the fullest core's: a request lands on one of them.
"""

from __future__ import annotations

import msgspec

from pdkv.metrics import Exposition

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
LOAD_NAMES = (RUNNING, WAITING, KV_USAGE, PREFIX_QUERIES, PREFIX_HITS)


class EngineLoad(msgspec.Struct, frozen=True):
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    prefix_queries: float = 0.0  # tokens, since the engine started
    prefix_hits: float = 0.0

    @property
    def requests(self) -> int:
        return self.running + self.waiting


class EngineMetrics(Exposition):
    """One scrape of an engine's /metrics: its samples, asked by name, and the load they show."""

    __slots__ = ()

    def load(self) -> EngineLoad | None:
        """The load this scrape shows, or None when it names none of the load gauges (not vLLM)."""
        if not any(n in LOAD_NAMES for n, _, _ in self.samples):
            return None
        return EngineLoad(int(self.total(RUNNING)), int(self.total(WAITING)), min(self.highest(KV_USAGE), 1.0),
                          self.total(PREFIX_QUERIES), self.total(PREFIX_HITS))


def parse_engine_load(text: str | bytes) -> EngineLoad | None:
    """The load in one scrape of a vLLM engine's /metrics, or None when it names none of the gauges (not vLLM)."""
    return EngineMetrics.parse(text, LOAD_NAMES).load()

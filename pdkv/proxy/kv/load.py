"""What an engine's own `/metrics` says of its load and its prefix cache (pure: text in, numbers out).

vLLM exports, per engine core (label `engine`, one per DP rank):

    vllm:num_requests_running        gauge    requests in its running batch
    vllm:num_requests_waiting        gauge    requests queued for it
    vllm:kv_cache_usage_perc         gauge    0..1 of its KV blocks in use
    vllm:prefix_cache_queries_total  counter  prompt tokens looked up in its prefix cache
    vllm:prefix_cache_hits_total     counter  of those, tokens found there

Only those lines are read (a scan, not a full exposition parse: an engine's
/metrics is tens of kilobytes of histograms, read every second). Samples of
several engine cores add up, but KV usage is the fullest core's: a request
lands on one of them.
"""

from __future__ import annotations

import math

import msgspec

_RUNNING = b"vllm:num_requests_running"
_WAITING = b"vllm:num_requests_waiting"
_USAGE = b"vllm:kv_cache_usage_perc"
_QUERIES = b"vllm:prefix_cache_queries_total"
_HITS = b"vllm:prefix_cache_hits_total"
_NAMES = (_RUNNING, _WAITING, _USAGE, _QUERIES, _HITS)


class EngineLoad(msgspec.Struct, frozen=True):
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    prefix_queries: float = 0.0  # tokens, since the engine started
    prefix_hits: float = 0.0

    @property
    def requests(self) -> int:
        return self.running + self.waiting


def _sample_value(rest: bytes) -> float | None:
    """The value of a sample line after its name: `{labels} value [timestamp]` or ` value [timestamp]`."""
    if rest.startswith(b"{"):
        rest = rest.rpartition(b"}")[2]
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def parse_engine_metrics(text: bytes) -> EngineLoad | None:
    """The load in one scrape of a vLLM engine's /metrics, or None when it names none of the gauges (not vLLM)."""
    sums = dict.fromkeys(_NAMES, 0.0)
    seen = False
    usage = 0.0
    for line in text.splitlines():
        if not line.startswith(b"vllm:"):
            continue
        for name in _NAMES:
            if line.startswith(name) and line[len(name) : len(name) + 1] in (b"{", b" "):
                value = _sample_value(line[len(name) :])
                if value is None:
                    break
                seen = True
                if name is _USAGE:
                    usage = max(usage, min(value, 1.0))
                else:
                    sums[name] += value
                break
    if not seen:
        return None
    return EngineLoad(int(sums[_RUNNING]), int(sums[_WAITING]), usage, sums[_QUERIES], sums[_HITS])


def counter_delta(before: float | None, after: float) -> float:
    """How much a counter grew between two scrapes; a counter that went down was reset (the engine restarted)."""
    if before is None:
        return 0.0
    return after - before if after >= before else after

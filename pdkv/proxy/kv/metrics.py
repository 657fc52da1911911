"""The kv-aware policy's Prometheus metrics, on the proxy's registry (every method is safe from any thread).

    pdkv_proxy_kv_route_total{reason}                      routing decisions: local_prefill, prefix_hit, least_cost, unkeyed
    pdkv_proxy_kv_hit_tokens_total{engine,source}          prompt tokens the chosen engines held at routing time,
                                                           source=reported (by its events) or predicted (routed, not yet reported)
    pdkv_proxy_kv_prompt_tokens_total                      prompt tokens of keyed requests (the hit rate's denominator)
    pdkv_proxy_kv_event_lag_seconds                        an event batch's engine timestamp to its arrival here
    pdkv_proxy_kv_event_blocks_total{engine,kind}          blocks stored, removed, orphaned (parent never seen)
    pdkv_proxy_kv_replays_total{engine,reason}             connected, restarted, gap, timeout
    pdkv_proxy_kv_approximate{engine}                      1 while the engine is routed by the proxy's own view
    pdkv_proxy_kv_fallbacks_total{engine,reason}           entries into that view: disconnected, silent
    pdkv_proxy_kv_decode_errors_total{engine}              unreadable messages
    pdkv_proxy_kv_self_check{engine}                       1 keys match the engine's, 0 mismatch, -1 no events seen
    pdkv_proxy_kv_tokenizer_match                          1 the proxy's --tokenizer agrees with the engines, 0 not (not used)
    pdkv_proxy_kv_tokenize_seconds                         getting a request's token ids
    pdkv_proxy_kv_engine_hit_tokens_total{engine}          prompt tokens the engine itself found in its prefix cache
                                                           (vllm:prefix_cache_hits, read from its /metrics since the proxy started)
    pdkv_proxy_kv_engine_query_tokens_total{engine}        prompt tokens the engine looked up there (vllm:prefix_cache_queries)
    pdkv_proxy_kv_engine_kv_usage_ratio{engine}            its KV usage, 0..1, as last read (vllm:kv_cache_usage_perc)
    pdkv_proxy_kv_engine_scrape_errors_total{engine}       /metrics readings that failed or named no vLLM gauge
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdkv.metrics import histogram
from pdkv.proxy.kv.events import EventBatch
from pdkv.proxy.kv.subscriber import StreamObserver


class KvMetrics(StreamObserver):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.route = Counter("pdkv_proxy_kv_route_total", "kv-aware routing decisions, by reason.", ["reason"], registry=r)
        self.hit_tokens = Counter("pdkv_proxy_kv_hit_tokens_total", "Prompt tokens the chosen engine held when routed.",
                                  ["engine", "source"], registry=r)
        self.prompt_tokens = Counter("pdkv_proxy_kv_prompt_tokens_total", "Prompt tokens of requests routed by their keys.", registry=r)
        self.lag = histogram("pdkv_proxy_kv_event_lag_seconds", "KV event batch timestamp to its arrival at the proxy.", r)
        self.blocks = Counter("pdkv_proxy_kv_event_blocks_total", "Blocks in KV events, by kind.", ["engine", "kind"], registry=r)
        self.replays = Counter("pdkv_proxy_kv_replays_total", "Replays asked of an engine, by reason.", ["engine", "reason"], registry=r)
        self.approximate = Gauge("pdkv_proxy_kv_approximate", "1 while the engine is routed by the proxy's own view.", ["engine"],
                                 registry=r)
        self.fallbacks = Counter("pdkv_proxy_kv_fallbacks_total", "Falls back to the proxy's own view, by reason.", ["engine", "reason"],
                                 registry=r)
        self.decode_errors = Counter("pdkv_proxy_kv_decode_errors_total", "Unreadable KV event messages.", ["engine"], registry=r)
        self.self_check = Gauge("pdkv_proxy_kv_self_check", "1: keys match the engine's events; 0: mismatch; -1: no events.",
                                ["engine"], registry=r)
        self.tokenizer_match = Gauge("pdkv_proxy_kv_tokenizer_match", "1: the proxy's --tokenizer gives the engines' token ids; "
                                     "0: it did not (the engines' /tokenize is used); -1: not checked or none.", registry=r)
        self.tokenizer_match.set(-1)
        self.tokenize = histogram("pdkv_proxy_kv_tokenize_seconds", "Getting one request's token ids.", r)
        self.engine_hit_tokens = Counter("pdkv_proxy_kv_engine_hit_tokens_total", "Prompt tokens the engine found in its prefix "
                                         "cache, by its own /metrics.", ["engine"], registry=r)
        self.engine_query_tokens = Counter("pdkv_proxy_kv_engine_query_tokens_total", "Prompt tokens the engine looked up in its "
                                           "prefix cache, by its own /metrics.", ["engine"], registry=r)
        self.engine_kv_usage = Gauge("pdkv_proxy_kv_engine_kv_usage_ratio", "The engine's KV usage (0..1) as last read from its /metrics.",
                                     ["engine"], registry=r)
        self.engine_scrape_errors = Counter("pdkv_proxy_kv_engine_scrape_errors_total", "Readings of an engine's /metrics that "
                                            "failed or named no vLLM gauge.", ["engine"], registry=r)

    # --- StreamObserver (the subscriber's thread)
    def batch(self, engine: str, batch: EventBatch, lag_s: float, stored: int, removed: int, orphans: int) -> None:
        self.lag.observe(lag_s)
        if stored:
            self.blocks.labels(engine, "stored").inc(stored)
        if removed:
            self.blocks.labels(engine, "removed").inc(removed)
        if orphans:
            self.blocks.labels(engine, "orphaned").inc(orphans)

    def replay(self, engine: str, reason: str) -> None:
        self.replays.labels(engine, reason).inc()

    def mode(self, engine: str, approximate: bool, reason: str) -> None:
        self.approximate.labels(engine).set(int(approximate))
        if approximate:
            self.fallbacks.labels(engine, reason).inc()

    def decode_error(self, engine: str) -> None:
        self.decode_errors.labels(engine).inc()


def counter_delta(before: float | None, after: float) -> float:
    """How much a counter grew between two scrapes; a counter that went down was reset (the engine restarted)."""
    if before is None:
        return 0.0
    return after - before if after >= before else after

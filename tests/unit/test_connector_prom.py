"""The connector's figures as vLLM exports them on the engine's /metrics (pdkv.connector.prom): the same families
as the side channel's StatsReply text, summed over TP ranks, each step's counts added once."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

pytest.importorskip("vllm")

from pdkv.connector.prom import PdkvConnectorStats, PdkvPromMetrics
from pdkv.connector.timing import TraceLog


def _trace_log_with_one_transfer(tid: str = "x1") -> TraceLog:
    log = TraceLog("prefill")
    log.event(tid, "transfer_start", 100.0)
    log.event(tid, "transfer_end", 100.004)
    log.finish(tid, "sent", nbytes=1000, descriptors=3)
    return log


def _metrics(role: str) -> tuple[PdkvPromMetrics, CollectorRegistry]:
    r = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=r) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role="kv_producer" if role == "prefill" else "kv_consumer"))
    return PdkvPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]}), r


def test_take_stats_hands_over_each_count_once() -> None:
    log = _trace_log_with_one_transfer()
    log.auth_refused("stale")
    delta = log.take_stats()
    assert delta is not None and (delta.transfers, delta.bytes, delta.auth_refused) == ({"sent": 1}, 1000, {"stale": 1})
    assert log.take_stats() is None


def test_ranks_aggregate_and_the_engine_exports_the_side_channel_families() -> None:
    rank0, rank1 = _trace_log_with_one_transfer("a"), _trace_log_with_one_transfer("b")
    rank1.finish("c", "expired")
    stats = PdkvConnectorStats.of(rank0.take_stats()).aggregate(PdkvConnectorStats.of(rank1.take_stats()))
    assert stats.reduce() == {"transfers": 3, "failed": 0, "bytes": 2000}
    prom, registry = _metrics("prefill")
    prom.observe(stats.to_dict(), engine_idx=0)
    exported = {m.name: m.type for m in registry.collect()}
    side_channel = {m.name: m.type for m in TraceLog("prefill").registry.collect()}
    assert exported == side_channel
    value = registry.get_sample_value
    labels = {"model_name": "tiny", "engine": "0", "role": "prefill"}
    assert value("pdkv_connector_transfers_total", {**labels, "outcome": "sent"}) == 2
    assert value("pdkv_connector_transfers_total", {**labels, "outcome": "expired"}) == 1
    assert value("pdkv_connector_transfers_total", {**labels, "outcome": "failed"}) == 0  # shown before any failure
    assert value("pdkv_connector_bytes_total", labels) == 2000
    assert value("pdkv_connector_transfer_seconds_count", labels) == 2


def test_decode_shows_its_recomputes_at_zero_from_the_start() -> None:
    prom, registry = _metrics("decode")
    labels = {"model_name": "tiny", "engine": "0", "role": "decode", "outcome": "failed"}
    assert registry.get_sample_value("pdkv_connector_transfers_total", labels) == 0
    prom.observe({"transfers": {"failed": 2}}, engine_idx=0)
    assert registry.get_sample_value("pdkv_connector_transfers_total", labels) == 2

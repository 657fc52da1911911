"""pdkv.top.model: two readings -> rates, quantiles of what was observed between them, gauges as they are."""

from __future__ import annotations

import math

import msgspec
import pytest

from pdkv.engine_api import EngineMetrics
from pdkv.metrics import Exposition
from pdkv.top.collect import engine_figures, proxy_figures
from pdkv.top.model import EngineReading, Histogram, Reading, view

INF = math.inf


def test_quantile_interpolates_within_its_bucket_as_prometheus_does() -> None:
    h = Histogram([(0.1, 10.0), (0.2, 30.0), (0.4, 40.0), (INF, 40.0)])
    assert h.quantile(0.25) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert h.quantile(0.5) == pytest.approx(0.15)  # rank 20: half-way through (0.1, 0.2]
    assert h.quantile(0.9) == pytest.approx(0.32)  # rank 36: 6 of the 10 in (0.2, 0.4]
    assert Histogram([(0.1, 0.0), (INF, 0.0)]).quantile(0.5) is None
    assert Histogram([(0.1, 0.0), (INF, 5.0)]).quantile(0.5) == 0.1  # all in the open bucket: its lower bound


def test_the_view_counts_only_what_happened_between_the_readings() -> None:
    engines0 = [EngineReading(role="prefill", url="http://p", up=True, transfers={"sent": 10.0, "failed": 1.0}, kv_bytes=1e6),
                EngineReading(role="decode", url="http://d", up=True, transfers={"sent": 10.0, "failed": 0.0},
                              itl=Histogram([(0.01, 100.0), (0.02, 100.0), (INF, 100.0)]))]  # fmt: skip
    engines1 = [EngineReading(role="prefill", url="http://p", up=True, running=2, waiting=1, kv_usage=0.25,
                              transfers={"sent": 30.0, "failed": 1.0, "expired": 2.0}, kv_bytes=5e6),
                EngineReading(role="decode", url="http://d", up=False, reason="health check failed", waiting_for_kv=3,
                              transfers={"sent": 30.0, "failed": 1.0},
                              itl=Histogram([(0.01, 100.0), (0.02, 200.0), (INF, 200.0)]))]  # fmt: skip
    before = Reading(at=10.0, wall=1e9, proxy_url="http://x", proxy_up=True, proxy_metrics=True, requests=100,
                     errors={"decode_status": 1.0}, ttft=Histogram([(0.1, 100.0), (0.5, 100.0), (INF, 100.0)]),
                     engines=engines0)  # fmt: skip
    now = Reading(at=12.0, wall=1e9 + 2, proxy_url="http://x", proxy_up=True, proxy_metrics=True, requests=140,
                  errors={"decode_status": 3.0}, local_prefill={"no_prefill": 4.0},
                  ttft=Histogram([(0.1, 100.0), (0.5, 140.0), (INF, 140.0)]), desired={"prefill": 2.0, "decode": 1.0},
                  current={"prefill": 1.0, "decode": 1.0}, engines=engines1)  # fmt: skip
    v = view(before, now)
    assert v.window_s == 2.0 and not v.ok
    assert [(e.name, e.up, e.running, e.waiting, e.kv_usage, e.waiting_for_kv) for e in v.engines] == [
        ("prefill-0", True, 2, 1, 0.25, 0), ("decode-0", False, 0, 0, 0.0, 3)]
    s = v.serving
    assert (s.requests_per_s, s.requests, s.errors, s.errors_per_s, s.local_fallbacks) == (20.0, 140, 3, 1.0, 4)
    assert s.ttft_p50_ms == pytest.approx(300.0)  # the 40 new ones all in (0.1, 0.5]: its middle
    assert s.itl_p50_ms == pytest.approx(15.0)  # the 100 new ones all in (0.01, 0.02]
    t = v.transfers
    assert (t.per_s, t.bytes_per_s, t.sent, t.failures, t.recomputes) == (11.0, 2e6, 30, 3, 1)
    assert v.planner is not None and v.planner.desired == {"decode": 1, "prefill": 2}


def test_one_reading_or_a_proxy_not_read_has_no_rates() -> None:
    down = Reading(at=1.0, wall=1.0, proxy_url="http://x", proxy_up=False, proxy_reason="unreachable (ConnectError)")
    for v in (view(None, down), view(down, msgspec.structs.replace(down, at=2.0))):
        assert v.window_s is None and v.serving.requests_per_s is None and v.transfers.bytes_per_s is None
        assert v.planner is None and not v.ok


def test_figures_are_read_from_the_exposition_text() -> None:
    proxy = proxy_figures(Exposition.parse('pdkv_proxy_requests_total{status="200"} 5\npdkv_proxy_requests_total{status="502"} 1\n'
                          'pdkv_proxy_ttfb_seconds_bucket{le="0.1"} 4\npdkv_proxy_ttfb_seconds_bucket{le="+Inf"} 6\n'
                          'pdkv_planner_desired_engines{role="prefill"} 2\n'))  # fmt: skip
    assert proxy["requests"] == 6 and proxy["ttft"].buckets == [(0.1, 4.0), (INF, 6.0)] and proxy["desired"] == {"prefill": 2.0}
    engine = engine_figures(EngineMetrics.parse('vllm:num_requests_running{engine="0"} 3\nvllm:kv_cache_usage_perc{engine="0"} 0.5\n'
                            'vllm:num_requests_kv_fetch_by_stage{stage="in_progress"} 2\n'
                            'pdkv_connector_transfers_total{role="decode",outcome="failed"} 1\n'))  # fmt: skip
    assert (engine["running"], engine["kv_usage"], engine["waiting_for_kv"], engine["transfers"]) == (3, 0.5, 2, {"failed": 1.0})

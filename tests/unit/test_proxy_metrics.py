"""The proxy's metrics and its ring buffer of request timings (pure)."""

from __future__ import annotations

import pytest

from pdkv.proxy_api import ProxyTiming
from pdkv.proxy.metrics import ProxyMetrics, TimingLog


def _timing(rid: str, **kw) -> ProxyTiming:
    return ProxyTiming(request_id=rid, transfer_id=f"xfer-{rid}", endpoint="/v1/completions", **kw)


def test_histogram_buckets_are_cumulative():
    m = ProxyMetrics()
    for s in (0.0002, 0.003, 0.003, 7.0):
        m.prefill.observe(s)
    lines = m.render([]).splitlines()
    assert 'pdkv_proxy_prefill_seconds_bucket{le="0.0005"} 1.0' in lines
    assert 'pdkv_proxy_prefill_seconds_bucket{le="0.005"} 3.0' in lines
    assert 'pdkv_proxy_prefill_seconds_bucket{le="10.0"} 4.0' in lines
    assert 'pdkv_proxy_prefill_seconds_bucket{le="+Inf"} 4.0' in lines
    assert "pdkv_proxy_prefill_seconds_count 4.0" in lines


def test_metrics_split_ttft_and_count_errors_by_cause():
    m = ProxyMetrics()
    m.observe(_timing("a", received=10.0, prefill_dispatched=10.001, prefill_responded=10.05, decode_first_byte=10.06,
                      last_byte=10.2, status=200))
    m.observe(_timing("b", received=11.0, prefill_dispatched=11.0, status=504, error="prefill_timeout"))
    text = m.render([("prefill", "http://p:1", True, 0), ("decode", "http://d:1", False, 2)])
    assert 'pdkv_proxy_requests_total{status="200"} 1' in text
    assert 'pdkv_proxy_errors_total{cause="prefill_timeout"} 1' in text
    assert 'pdkv_proxy_errors_total{cause="decode_status"} 0' in text
    assert "pdkv_proxy_prefill_seconds_count 1" in text
    assert "pdkv_proxy_decode_wait_seconds_count 1" in text
    assert "pdkv_proxy_ttfb_seconds_count 1" in text
    assert 'pdkv_proxy_backend_up{role="decode",url="http://d:1"} 0' in text
    assert 'pdkv_proxy_outstanding_requests{role="decode",url="http://d:1"} 2' in text
    assert m.registry.get_sample_value("pdkv_proxy_ttfb_seconds_sum") == pytest.approx(0.06, abs=1e-6)


def test_backends_gone_from_the_rows_are_gone_from_the_gauges():
    m = ProxyMetrics()
    m.render([("prefill", "http://p:1", True, 0), ("decode", "http://d:1", True, 1)])
    text = m.render([("decode", "http://d:1", False, 0)])
    assert 'url="http://p:1"' not in text
    assert 'pdkv_proxy_backend_up{role="decode",url="http://d:1"} 0.0' in text


def test_timing_log_is_bounded_and_finds_by_request_or_transfer_id():
    log = TimingLog(3)
    for i in range(5):
        log.add(_timing(f"r{i}", error="no_backend" if i % 2 else None))
    assert len(log) == 3
    assert log.get("r0") is None and log.get("r1") is None
    assert log.get("r4").request_id == "r4"
    assert log.get("xfer-r3").request_id == "r3"
    assert [t.request_id for t in log.recent(10)] == ["r4", "r3", "r2"]
    assert [t.request_id for t in log.recent(10, lambda t: t.error is not None)] == ["r3"]
    assert [t.request_id for t in log.recent(1)] == ["r4"]

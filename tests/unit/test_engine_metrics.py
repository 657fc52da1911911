"""Reading an engine's /metrics for its load (pdkv.engine_api), and the kv-aware policy's cost of D from it."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from pdkv.engine_api import EngineLoad
from pdkv.engine_api import parse_engine_load as parse_engine_metrics
from pdkv.proxy.kv.metrics import counter_delta
from pdkv.proxy.kv.policy import DecodeCandidate, KvConfig, KvWeights, place_request

# The shape of vLLM 0.32's exposition: HELP/TYPE lines, one sample per engine core, _created samples, histograms.
TWO_CORES = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7646e+09
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 24.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 640.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
python_gc_objects_collected_total{generation="0"} 4242.0
"""


def test_a_two_core_engine_adds_its_requests_and_hits_and_takes_its_fullest_kv_usage():
    load = parse_engine_metrics(TWO_CORES)
    assert load == EngineLoad(running=3, waiting=3, kv_usage=0.5, prefix_queries=1024.0, prefix_hits=640.0)
    assert load.requests == 6


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"", None),
        (b"python_gc_objects_collected_total 1.0\nprocess_cpu_seconds_total 3.0\n", None),  # not vLLM
        (b"vllm:num_requests_running 4.0\n", EngineLoad(running=4)),  # no labels
        (b"vllm:num_requests_running{engine=\"0\"} 4.0 1700000000000\n", EngineLoad(running=4)),  # with a timestamp
        (b"vllm:num_requests_running{engine=\"0\"} NaN\nvllm:num_requests_waiting{} -1\n", None),  # no usable value
        (b"vllm:kv_cache_usage_perc{engine=\"0\"} 7.5\n", EngineLoad(kv_usage=1.0)),  # clamped to 0..1
        (b"vllm:num_requests_running{engine=\"0\"} lots\nvllm:num_requests_waiting{engine=\"0\"} 2\n", EngineLoad(waiting=2)),
        (b'vllm:num_requests_running{engine="0",note="a } b"} 5\n', EngineLoad(running=5)),  # a brace in a label value
    ],
)
def test_odd_expositions_read_what_they_can_and_never_raise(text, expected):
    assert parse_engine_metrics(text) == expected


def test_a_counter_that_went_down_was_reset_and_counts_from_zero():
    assert counter_delta(None, 500.0) == 0.0  # the first reading is the baseline
    assert counter_delta(500.0, 640.0) == 140.0
    assert counter_delta(640.0, 30.0) == 30.0  # the engine restarted


def _router():
    from pdkv.proxy.backends import Backends
    from pdkv.proxy.config import build_config
    from pdkv.proxy.engine_loads import EngineLoads
    from pdkv.proxy.kv_router import KvRouter

    backends = Backends(build_config(["http://127.0.0.1:9,8998"], ["http://127.0.0.1:10"], port=0))
    return KvRouter(KvConfig(), CollectorRegistry(), backends, EngineLoads(backends))


class _D:
    def __init__(self, url: str, outstanding: int) -> None:
        self.url, self.outstanding = url, outstanding


def test_d_counts_the_engines_own_requests_when_they_are_more_than_this_proxys_and_its_kv_usage():
    router, now = _router(), time.monotonic()
    router.loads.readings["http://d0"] = (EngineLoad(running=3, waiting=2, kv_usage=0.75), now)
    router.loads.readings["http://d1"] = (EngineLoad(running=0, kv_usage=0.1), now)
    assert router._decode_candidate(_D("http://d0", 1), [], now) == DecodeCandidate(0, 5, 0.75)  # others' requests count
    assert router._decode_candidate(_D("http://d1", 2), [], now) == DecodeCandidate(0, 2, 0.1)  # this proxy's, not yet there
    assert router._decode_candidate(_D("http://d2", 1), [], now) == DecodeCandidate(0, 1, 0.0)  # never read
    # A reading older than three intervals is not used.
    assert router._decode_candidate(_D("http://d0", 1), [], now + 3.5 * router.config.metrics_interval_s) == DecodeCandidate(0, 1)


def test_a_d_busy_with_other_clients_work_is_not_chosen_over_an_idle_one():
    router, now = _router(), time.monotonic()
    router.loads.readings["http://d0"] = (EngineLoad(running=6, kv_usage=0.6), now)
    router.loads.readings["http://d1"] = (EngineLoad(), now)
    decodes = [router._decode_candidate(_D(u, 0), [], now) for u in ("http://d0", "http://d1")]
    for start in range(4):  # whatever the round-robin cursor says
        assert place_request(500, 32, [], decodes, KvWeights(local_prefill_tokens=0), start=start).decode == 1

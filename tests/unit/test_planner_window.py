"""The observation a proxy builds from its window of finished requests (pdkv.planner.window), and the request
samples it keeps (pdkv.proxy.planner_loop.request_sample): pure, a fake clock."""

from __future__ import annotations

import msgspec
import pytest

from pdkv.planner import DesiredCounts, Observation, ScalePolicy, Slo
from pdkv.planner.window import RequestSample, observe_window, quantile
from pdkv.proxy_api import ProxyTiming
from pdkv.proxy.planner_loop import request_sample, usage_tokens
from support.planner_profiles import make_profile


def sample(at: float, ttft: float | None = 0.1, itl: float | None = 0.01, prompt: int = 100, output: int = 10) -> RequestSample:
    return RequestSample(at_s=at, prompt_tokens=prompt, output_tokens=output, ttft_s=ttft, itl_s=itl)


def test_quantile_is_the_nearest_rank():
    assert quantile([float(v) for v in range(1, 11)], 0.9) == 9.0
    assert quantile([5.0], 0.9) == 5.0
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_the_window_holds_only_its_own_requests_and_reads_their_rate_lengths_and_latencies():
    samples = [sample(t, ttft=t / 100, prompt=int(t)) for t in range(0, 100)]  # one a second, TTFT growing
    obs = observe_window(samples, now_s=99.5, window_s=10, quantile_q=0.9, prefill_engines=2, decode_engines=1, prefill_waiting=3)
    assert obs.rate == pytest.approx(1.0)  # 90..99: ten in ten seconds
    assert obs.prompt_tokens == list(range(90, 100)) and obs.output_tokens == [10] * 10
    assert obs.ttft_ms == pytest.approx(980.0)  # p90 of 900..990 ms
    assert obs.itl_ms == pytest.approx(10.0)
    assert (obs.prefill_engines, obs.decode_engines, obs.prefill_waiting, obs.at_s) == (2, 1, 3, 99.5)


def test_a_young_proxy_reads_its_rate_over_the_time_it_has_observed():
    samples = [sample(t * 0.1) for t in range(1, 21)]  # 20 requests in its first 2 s
    young = observe_window(samples, now_s=2.0, window_s=30, quantile_q=0.9, prefill_engines=1, decode_engines=1, since_s=0.0)
    assert young.rate == pytest.approx(10.0)
    old = observe_window(samples, now_s=2.0, window_s=30, quantile_q=0.9, prefill_engines=1, decode_engines=1)
    assert old.rate == pytest.approx(20 / 30)


def test_too_few_latencies_are_no_latency_and_an_empty_window_is_no_load():
    few = [sample(1.0), sample(2.0, ttft=None, itl=None), sample(3.0, itl=None)]
    obs = observe_window(few, now_s=3.0, window_s=10, quantile_q=0.9, prefill_engines=1, decode_engines=1)
    assert obs.ttft_ms is None and obs.itl_ms is None and obs.rate == pytest.approx(0.3)
    empty = observe_window([], now_s=3.0, window_s=10, quantile_q=0.9, prefill_engines=1, decode_engines=1)
    assert empty.rate == 0 and empty.prompt_tokens == [] and empty.ttft_ms is None


def test_an_observed_ttft_above_the_band_holds_the_count_the_model_would_let_go():
    profile = make_profile((10.0, 0.0, 0.1, 0.0), (20.0, 0.5, 0.0))
    sig = DesiredCounts(profile, Slo(400.0, 40.0), ScalePolicy(down_after_s=10, max_prefill=4))

    def obs(t: float, ttft: float | None) -> Observation:
        return Observation(at_s=t, rate=1.0, prompt_tokens=[100], output_tokens=[10], prefill_engines=3, decode_engines=1, ttft_ms=ttft)

    sig.update(obs(0, None))  # desired starts at the 3 serving
    assert sig.needs(obs(0, None))[1]["prefill"] == 1  # the model alone would keep one
    assert sig.needs(obs(0, 350.0))[1]["prefill"] == 3  # 350 ms is above 0.8 x 400: the engines say otherwise
    assert [sig.update(obs(t, 350.0)).prefill for t in (5, 15, 25)] == [3, 3, 3]
    assert sig.update(obs(30, 100.0)).prefill == 3 and sig.update(obs(41, 100.0)).prefill == 1


def timing(**kw) -> ProxyTiming:
    base = {"request_id": "r", "transfer_id": "xfer-" + "0" * 32, "endpoint": "/v1/completions", "received": 100.0,
            "prefill_responded": 100.2, "decode_first_byte": 100.3, "last_byte": 101.3, "status": 200}
    return msgspec.convert({**base, **kw}, ProxyTiming)


def test_a_streamed_request_gives_its_ttft_and_itl_and_its_lengths_from_usage_and_events():
    s = request_sample(timing(stream=True), b'{"usage": {"prompt_tokens": 512}}', b"", 11, clock_offset=-50.0)
    assert s == RequestSample(at_s=50.0, prompt_tokens=512, output_tokens=10, ttft_s=pytest.approx(0.3), itl_s=pytest.approx(1.0 / 9))


def test_an_unstreamed_request_takes_p_s_answer_as_its_ttft_and_has_no_itl():
    s = request_sample(timing(), b'{"usage": {"prompt_tokens": 7}}', b'{"usage": {"completion_tokens": 16}}', 0, clock_offset=0.0)
    assert (s.prompt_tokens, s.output_tokens, s.itl_s) == (7, 16, None) and s.ttft_s == pytest.approx(0.2)


def test_a_failed_request_leaves_no_sample_and_odd_bodies_count_nothing():
    assert request_sample(timing(status=502, error="decode_status"), b"", b"", 0, 0.0) is None
    assert request_sample(timing(status=None), b"", b"", 0, 0.0) is None
    for body in (b"", b"[]", b'{"usage": null}', b'{"usage": {"prompt_tokens": "x"}}', b"not json"):
        assert usage_tokens(body, "prompt_tokens") == 0


def test_a_count_raised_by_the_observed_latency_is_held_while_its_engine_starts():
    profile = make_profile((10.0, 0.0, 0.1, 0.0), (20.0, 0.5, 0.0))
    sig = DesiredCounts(profile, Slo(400.0, 40.0), ScalePolicy(down_after_s=10, max_prefill=4))
    slow = Observation(at_s=0, rate=1.0, prompt_tokens=[100], output_tokens=[10], prefill_engines=1, decode_engines=1, ttft_ms=900.0)
    assert sig.update(slow).prefill == 2  # the model says one is plenty; the engines say otherwise
    # The second P takes a minute to start: one serves meanwhile, and the latency stays over the target.
    assert {sig.update(msgspec.structs.replace(slow, at_s=t)).prefill for t in range(5, 65, 5)} == {2}
    need, keep = sig.needs(slow)
    assert need["prefill"] == keep["prefill"] == 2

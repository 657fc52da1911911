from __future__ import annotations

import math

import pytest

from pdkv.errors import UsageError
from pdkv.planner.capacity import _poisson_quantile, decode_batch, plan_capacity, predict, predict_prefill
from pdkv.planner.workload import Slo, Workload, make_workload, parse_lengths, parse_slo
from support.planner_profiles import make_profile

PROFILE = make_profile((10.0, 0.0, 0.1, 0.0), (20.0, 0.5, 0.0))  # prefill 10 ms + 0.1 ms/token; ITL 20 ms + 0.5 ms/seq


def fixed(rate: float, prompt: int = 1000, output: int = 100) -> Workload:
    return Workload(rate=rate, prompt_tokens=[prompt], output_tokens=[output])


def test_idle_engine_ttft_is_the_prefill_alone_plus_what_comes_after():
    pre = predict_prefill(PROFILE, fixed(1e-9), 1, 0.9, extra_ms=7.0)
    assert pre.latency_ms == pytest.approx(PROFILE.prefill_fit.prompt_ms(1000) + 7.0, rel=1e-6)


def test_time_outside_the_engine_is_in_ttft_but_not_in_ps_load():
    outside = make_profile((10.0, 0.0, 0.1, 0.0), (20.0, 0.5, 0.0), outside_ms=15.0)
    idle = predict_prefill(outside, fixed(1e-9), 1, 0.9, extra_ms=7.0)
    assert idle.latency_ms == pytest.approx(outside.prefill_fit.prompt_ms(1000) + 15.0 + 7.0, rel=1e-6)
    busy, same = predict_prefill(outside, fixed(5.0), 1, 0.9, 0.0), predict_prefill(PROFILE, fixed(5.0), 1, 0.9, 0.0)
    assert busy.utilization == same.utilization == pytest.approx(5.0 * 0.110)
    assert busy.latency_ms == pytest.approx(same.latency_ms + 15.0, rel=1e-6)


def test_mm1_tail_matches_its_closed_form():
    # Fixed-length prompts: M/D/1. Its wait here: mass 1-rho at 0, an exponential tail of mean E[W]/rho beyond.
    s = PROFILE.prefill_fit.prompt_ms(1000) / 1000
    rate = 0.7 / s
    pre = predict_prefill(PROFILE, fixed(rate), 1, 0.9, extra_ms=0.0)
    rho = rate * s
    wait = rate * s * s / (2 * (1 - rho))
    expected = s + wait / rho * math.log(rho / 0.1)
    assert pre.utilization == pytest.approx(rho)
    assert pre.latency_ms == pytest.approx(expected * 1000, rel=1e-4)


def test_overloaded_prefill_is_infinite():
    s = PROFILE.prefill_fit.prompt_ms(1000) / 1000
    assert math.isinf(predict_prefill(PROFILE, fixed(1.01 / s), 1, 0.9, 0.0).latency_ms)
    assert math.isfinite(predict_prefill(PROFILE, fixed(1.01 / s), 2, 0.9, 0.0).latency_ms)


def test_decode_batch_solves_littles_law():
    w = fixed(50.0, prompt=500, output=200)
    m = decode_batch(PROFILE, w, 10)
    itl = PROFILE.decode_fit.itl_ms(m, m * 600)
    assert m == pytest.approx(50.0 / 10 * 200 * itl / 1000, rel=1e-9)
    assert math.isinf(decode_batch(PROFILE, w, 1)) is (50 * 200 * 0.5 / 1000 >= 1)


def test_poisson_quantile():
    assert _poisson_quantile(0, 0.9) == 0
    k = _poisson_quantile(4.0, 0.9)
    cdf = lambda n: sum(math.exp(-4) * 4**i / math.factorial(i) for i in range(n + 1))  # noqa: E731
    assert cdf(k) >= 0.9 > cdf(k - 1)
    big = _poisson_quantile(1e4, 0.9)
    assert 1e4 + 1.2 * 100 < big < 1e4 + 1.35 * 100  # mean + z(0.9) sigma, sigma = 100


@pytest.mark.parametrize("rate", [2.0, 20.0, 80.0])
def test_plan_is_the_fewest_meeting_both_targets(rate):
    slo = Slo(ttft_ms=400.0, itl_ms=40.0)
    w = fixed(rate)
    plan = plan_capacity(PROFILE, w, slo)
    assert plan.feasible
    p, d = plan.prefill_engines, plan.decode_engines
    ok = predict(PROFILE, w, p, d, 0.9)
    assert ok.ttft_ms <= slo.ttft_ms and ok.itl_ms <= slo.itl_ms
    if p > 1:
        assert predict(PROFILE, w, p - 1, d, 0.9).ttft_ms > slo.ttft_ms
    if d > 1:
        assert predict(PROFILE, w, p, d - 1, 0.9).itl_ms > slo.itl_ms
    assert plan.prediction == ok


def test_counts_grow_with_rate_and_the_binding_role_follows_the_traffic():
    slo = Slo(ttft_ms=400.0, itl_ms=40.0)
    low, high = plan_capacity(PROFILE, fixed(5.0), slo), plan_capacity(PROFILE, fixed(50.0), slo)
    assert high.prefill_engines > low.prefill_engines and high.decode_engines > low.decode_engines
    long_prompts = plan_capacity(PROFILE, fixed(30.0, prompt=3000, output=10), slo)
    long_outputs = plan_capacity(PROFILE, fixed(30.0, prompt=100, output=2000), slo)
    assert long_prompts.prefill_engines > long_prompts.decode_engines and long_prompts.binding_role == "prefill"
    assert long_outputs.decode_engines > long_outputs.prefill_engines and long_outputs.binding == "itl"


def test_kv_capacity_asks_for_more_d_than_itl_alone():
    slo = Slo(ttft_ms=400.0, itl_ms=200.0)
    w = fixed(20.0, prompt=2000, output=500)
    free = plan_capacity(PROFILE, w, slo)
    tight = plan_capacity(make_profile((10.0, 0.0, 0.1, 0.0), (20.0, 0.5, 0.0), capacity=20_000), w, slo)
    assert tight.decode_engines > free.decode_engines
    assert tight.prediction.kv_fits
    # What set D's count is named: the KV (its 99th-percentile need near what D holds), not the ITL far below target.
    assert tight.binding == "kv" and tight.binding_role == "decode"
    assert tight.prediction.itl_ms / slo.itl_ms < tight.prediction.kv_share <= 1.0
    assert free.binding != "kv" and free.prediction.kv_share == 0.0  # capacity unknown: no KV share


def test_infeasible_targets_say_why():
    plan = plan_capacity(PROFILE, fixed(1.0, prompt=8000), Slo(ttft_ms=500.0, itl_ms=40.0))
    assert not plan.feasible and "longest prompt alone" in plan.reason
    plan = plan_capacity(PROFILE, fixed(1.0), Slo(ttft_ms=500.0, itl_ms=15.0))
    assert not plan.feasible and "decodes at" in plan.reason and plan.binding_role == "decode"


def test_workload_words():
    assert parse_lengths("1000", "--x") == [1000]
    r = parse_lengths("100-200", "--x")
    assert min(r) > 100 and max(r) < 200 and len(r) > 10
    assert parse_lengths("1,2,3", "--x") == [1, 2, 3]
    assert parse_slo("ttft=500,itl=50") == Slo(500.0, 50.0, 0.9)
    assert parse_slo("itl_ms=5, ttft_p90=9", 0.99) == Slo(9.0, 5.0, 0.99)
    for bad in ("ttft=500", "ttft=-1,itl=2", "tpot=1,itl=2", "ttft"):
        with pytest.raises(UsageError):
            parse_slo(bad)
    with pytest.raises(UsageError):
        make_workload(None, "100", "10")


def test_trace_file_gives_lengths_and_rate(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {i * 0.5}, "prompt_tokens": {100 + i}, "output_tokens": 10}}\n' for i in range(5)))
    w = make_workload(None, "1", "1", trace)
    assert w.rate == pytest.approx(4 / 2.0) and w.prompt_tokens == [100, 101, 102, 103, 104]
    assert make_workload(7.0, "1", "1", trace).rate == 7.0


def test_round_robin_over_n_engines_waits_as_kingman_says():
    # Each of n P sees every n-th arrival of a Poisson stream (Erlang-n gaps, c_a^2 = 1/n); fixed prompts (c_s^2 = 0).
    s = PROFILE.prefill_fit.prompt_ms(1000) / 1000
    n, rho = 4, 0.8
    pre = predict_prefill(PROFILE, fixed(n * rho / s), n, 0.9, extra_ms=0.0)
    wait = (1 / n) / 2 * rho / (1 - rho) * s
    assert pre.latency_ms == pytest.approx((s + wait / rho * math.log(rho / 0.1)) * 1000, rel=1e-4)
    alone = predict_prefill(PROFILE, fixed(rho / s), 1, 0.9, extra_ms=0.0)
    assert pre.latency_ms < alone.latency_ms  # the same load per engine queues less when dealt out in turn

from __future__ import annotations

import math

import pytest

from pdkv.planner.capacity import decode_batch, plan_capacity, predict_decode, predict_prefill
from pdkv.planner.day import DayLoad, compare_day, simulate_planner, simulate_static
from pdkv.planner.signal import ScalePolicy
from pdkv.planner.simulate import SimConfig, Simulation
from pdkv.planner.workload import Slo, Workload
from support.planner_profiles import make_profile

PROFILE = make_profile((10.0, 0.0, 0.1, 0.0), (20.0, 0.5, 0.0), handover_ms=3.0)
SLO = Slo(ttft_ms=400.0, itl_ms=40.0)


def run(rate: float, seconds: float, p: int = 1, d: int = 1, *, profile=PROFILE, prompt=1000, output=50, **cfg) -> Simulation:
    sim = Simulation(profile, Workload(rate, [prompt], [output]), SLO, lambda t: rate, rate, SimConfig(duration_s=seconds, **cfg), p, d)
    sim.result = sim.run()
    return sim


def test_a_request_alone_takes_the_profiles_times():
    sim = run(0.05, 400, output=20)  # one request every 20 s: none overlaps another
    assert len(sim.arrival) > 5
    step = PROFILE.decode_fit.itl_ms(1, 0)
    for a, f, done in zip(sim.arrival, sim.first, sim.done, strict=True):
        ttft = (f - a) * 1000
        assert ttft == pytest.approx(PROFILE.prefill_fit.prompt_ms(1000) + PROFILE.handover_ms + step, rel=1e-9)
        assert (done - f) * 1000 == pytest.approx(19 * step, rel=1e-9)
    assert sim.result.attainment == 1.0


def test_the_time_outside_ps_engine_delays_each_request_and_holds_no_engine():
    profile = make_profile((10.0, 0.0, 0.1, 0.0), (20.0, 0.5, 0.0), handover_ms=3.0, outside_ms=12.0)
    alone = run(0.05, 400, output=20, profile=profile)
    step = profile.decode_fit.itl_ms(1, 0)
    for a, f in zip(alone.arrival, alone.first, strict=True):
        assert (f - a) * 1000 == pytest.approx(profile.prefill_fit.prompt_ms(1000) + 12.0 + 3.0 + step, rel=1e-9)
    # At 8 req/s P's engine is busy 88% of the time, with or without the 12 ms outside it: the same arrivals queue
    # alike on P, and every TTFT is 12 ms longer, no more.
    busy, same = run(8.0, 300, profile=profile), run(8.0, 300, profile=make_profile((10.0, 0.0, 0.1, 0.0), (20.0, 0.5, 0.0),
                                                                                     handover_ms=3.0))
    assert busy.result.ttft_p50_ms == pytest.approx(same.result.ttft_p50_ms + 12.0, rel=1e-9)
    assert busy.result.ttft_p90_ms == pytest.approx(same.result.ttft_p90_ms + 12.0, rel=1e-9)


def test_same_seed_same_day_and_another_seed_another():
    a, b, c = run(5.0, 60).result, run(5.0, 60).result, run(5.0, 60, seed=1).result
    assert a == b and a.requests != c.requests


def test_one_prompt_per_forward_is_the_queue_the_plan_models():
    # max_batch_tokens = one prompt: P serves one at a time, FCFS, fixed service: M/D/1, which the plan's formula is for.
    rate = 0.6 / (PROFILE.prefill_fit.prompt_ms(1000) / 1000)
    sim = run(rate, 3000, output=2, max_batch_tokens=1000)
    steps = [PROFILE.decode_fit.itl_ms(b, 0) for b in (1, 2)]
    waits = sorted((f - a) * 1000 for a, f in zip(sim.arrival, sim.first, strict=True))
    measured = waits[int(0.9 * len(waits))]
    predicted = predict_prefill(PROFILE, Workload(rate, [1000], [2]), 1, 0.9, PROFILE.handover_ms + steps[0]).latency_ms
    assert measured == pytest.approx(predicted, rel=0.1)


def test_more_load_than_the_engines_hold_misses_the_targets():
    plan = plan_capacity(PROFILE, Workload(20.0, [1000], [50]), SLO)
    enough = run(20.0, 120, plan.prefill_engines, plan.decode_engines).result
    short = run(20.0, 120, 1, plan.decode_engines).result
    assert enough.attainment >= 0.9 > short.attainment
    assert short.ttft_attainment < enough.ttft_attainment and short.itl_attainment == pytest.approx(enough.itl_attainment, abs=0.05)


def test_kv_that_does_not_fit_makes_sequences_wait():
    small = make_profile((10.0, 0.0, 0.1, 0.0), (20.0, 0.5, 0.0), capacity=3 * 1050)
    free, tight = run(10.0, 60, 2, 1, output=100).result, run(10.0, 60, 2, 1, profile=small, output=100).result
    assert tight.ttft_p90_ms > free.ttft_p90_ms and tight.requests == free.requests


def test_engine_hours_of_a_static_fleet():
    r = run(1.0, 3600, 2, 3).result
    assert r.prefill_engine_hours == pytest.approx(2.0, rel=0.01) and r.decode_engine_hours == pytest.approx(3.0, rel=0.01)


def test_the_planner_follows_the_day_and_loses_no_request():
    load = DayLoad(peak_rate=40.0, duration_s=1800, levels=(0.1, 0.1, 1.0, 1.0, 0.1, 0.1))
    cfg = SimConfig(duration_s=1800, startup_s=30, interval_s=10, window_s=30)
    policy = ScalePolicy(down_after_s=60)
    w = Workload(1.0, [1000], [50])
    r = simulate_planner(PROFILE, w, SLO, load, cfg, policy)
    assert all(not math.isnan(x) for x in (r.ttft_p90_ms, r.itl_p90_ms))
    low = [p for p in r.timeline if p.t < 250]
    high = [p for p in r.timeline if 800 < p.t < 1000]
    late = [p for p in r.timeline if p.t > 1700]
    assert max(p.prefill for p in low) < min(p.prefill for p in high)
    assert min(p.prefill for p in late) < max(p.prefill for p in high)  # drained back after the peak
    peak = plan_capacity(PROFILE, w.at_rate(40.0), SLO)
    static = simulate_static(PROFILE, w, SLO, load, cfg, peak.prefill_engines, peak.decode_engines)
    assert r.engine_hours < static.engine_hours
    assert r.requests == static.requests  # the same arrivals, every one answered
    assert r.attainment > 0.8


def test_compare_day_finds_a_static_fleet_as_good_as_the_planner():
    load = DayLoad(peak_rate=20.0, duration_s=1200, levels=(0.2, 1.0, 0.2))
    cfg = SimConfig(duration_s=1200, startup_s=30)
    c = compare_day(PROFILE, Workload(1.0, [1000], [50]), SLO, load, cfg, ScalePolicy(down_after_s=60))
    assert c.goal == c.planner.attainment
    assert c.static_meets_goal and c.static.attainment >= c.goal
    assert any(t.attainment < c.goal for t in c.tried)  # the search went below the answer and came back
    below = ((c.static_prefill - 1, c.static_decode), (c.static_prefill, c.static_decode - 1))
    fewer = [t for t in c.tried if (t.prefill, t.decode) in below]
    assert all(t.attainment < c.goal for t in fewer)


def test_decode_batch_and_itl_agree_with_the_plans_fixed_point():
    profile = make_profile((1.0, 0.0, 0.001, 0.0), (20.0, 0.5, 0.001))
    w = Workload(5.0, [500], [100])
    sim = run(5.0, 600, 4, 1, profile=profile, prompt=500, output=100)
    itl = sorted((d - f) * 1000 / 99 for f, d in zip(sim.first, sim.done, strict=True))
    m = decode_batch(profile, w, 1)
    assert sum(itl) / len(itl) == pytest.approx(profile.decode_fit.itl_ms(m, m * 550), rel=0.1)
    assert itl[int(0.9 * len(itl))] == pytest.approx(predict_decode(profile, w, 1, 0.9)[0].latency_ms, rel=0.15)

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdkv.errors import UsageError
from pdkv.metrics import render
from pdkv.planner.capacity import plan_capacity
from pdkv.planner.gauges import PlannerGauges
from pdkv.planner.signal import DesiredCounts, Observation, ScalePolicy
from pdkv.planner.workload import Slo, Workload
from support.planner_profiles import make_profile

PROFILE = make_profile((10.0, 0.0, 0.1, 0.0), (20.0, 0.5, 0.0))
SLO = Slo(ttft_ms=400.0, itl_ms=40.0)
PROMPTS, OUTPUTS = [1000], [100]


def obs(t: float, rate: float, p: int = 1, d: int = 1, **kw) -> Observation:
    return Observation(at_s=t, rate=rate, prompt_tokens=PROMPTS, output_tokens=OUTPUTS, prefill_engines=p, decode_engines=d, **kw)


def planned(rate: float) -> tuple[int, int]:
    plan = plan_capacity(PROFILE, Workload(rate, PROMPTS, OUTPUTS), SLO)
    return plan.prefill_engines, plan.decode_engines


def test_scales_up_at_once_to_what_the_plan_needs():
    sig = DesiredCounts(PROFILE, SLO, ScalePolicy(down_after_s=60))
    first = sig.update(obs(0, 1.0))
    assert (first.prefill, first.decode) == (1, 1)
    step = sig.update(obs(5, 40.0))
    assert (step.prefill, step.decode) == planned(40.0)
    assert step.prefill > 1 and step.binding in ("ttft", "itl")


def test_scales_down_only_after_the_quiet_lasts_to_what_sufficed_all_along_it():
    sig = DesiredCounts(PROFILE, SLO, ScalePolicy(down_after_s=60))
    high = sig.update(obs(0, 40.0))
    rates = [10.0 if t < 30 else 1.0 for t in range(5, 60, 5)]
    seen = [sig.update(obs(t, r)).prefill for t, r in zip(range(5, 60, 5), rates, strict=True)]
    assert set(seen) == {high.prefill}  # under a minute of quiet: nothing let go
    after = sig.update(obs(65, 1.0))
    # The highest keep over the wait is what 10 req/s needed: not less, though 1 req/s would need less.
    ten = sig.needs(obs(0, 10.0))[1]["prefill"]
    one = sig.needs(obs(0, 1.0))[1]["prefill"]
    assert one < ten < high.prefill
    assert after.prefill == ten
    assert sig.update(obs(70, 1.0)).prefill == ten  # the next step waits its own minute
    assert sig.update(obs(125, 1.0)).prefill == ten and sig.update(obs(130, 1.0)).prefill == one == 1
    assert sig.update(obs(1000, 1.0)).prefill == 1


def test_rate_wobbling_inside_the_band_does_not_flap():
    sig = DesiredCounts(PROFILE, SLO, ScalePolicy(down_after_s=30))
    wobble = [30.0 * (1.1 if t % 10 else 0.9) for t in range(0, 900, 5)]
    counts = [sig.update(obs(t, r)) for t, r in zip(range(0, 900, 5), wobble, strict=True)]
    settled = [(d.prefill, d.decode) for d in counts[2:]]
    assert len(set(settled)) == 1  # up to what the higher rate needs within two looks, then nothing moves
    assert settled[0] == max(planned(30.0 * 1.1), planned(30.0 * 0.9))
    # Without the band and the wait, the lower rate alone would have let an engine go.
    assert planned(30.0 * 0.9) != settled[0]


def test_up_after_waits_for_a_lasting_need():
    sig = DesiredCounts(PROFILE, SLO, ScalePolicy(up_after_s=10))
    sig.update(obs(0, 1.0))
    assert sig.update(obs(1, 40.0)).prefill == 1
    assert sig.update(obs(5, 1.0)).prefill == 1  # the spike ended: its wait is forgotten
    assert sig.update(obs(6, 40.0)).prefill == 1
    assert sig.update(obs(16, 40.0)).prefill == planned(40.0)[0]


def test_observed_latency_over_target_asks_for_one_more_than_now():
    sig = DesiredCounts(PROFILE, SLO)
    d = sig.update(obs(0, 1.0, p=2, d=2, ttft_ms=SLO.ttft_ms * 1.5, itl_ms=SLO.itl_ms * 2))
    assert (d.need_prefill, d.need_decode) == (3, 3) and (d.prefill, d.decode) == (3, 3)


def test_a_queue_on_p_counts_as_work_to_spread():
    sig = DesiredCounts(PROFILE, SLO)
    waiting = 50
    d = sig.update(obs(0, 0.5, prefill_waiting=waiting))
    expected = -(-waiting * PROFILE.prefill_fit.prompt_ms(PROMPTS[0]) // SLO.ttft_ms)
    assert d.prefill == expected


def test_bounds_hold():
    sig = DesiredCounts(PROFILE, SLO, ScalePolicy(min_prefill=2, max_prefill=3, min_decode=1, max_decode=2))
    assert sig.update(obs(0, 0.0)).prefill == 2
    d = sig.update(obs(1, 500.0))
    assert (d.prefill, d.decode) == (3, 2)
    with pytest.raises(UsageError):
        DesiredCounts(PROFILE, SLO, ScalePolicy(min_decode=3, max_decode=2))


def test_gauges_expose_the_decision():
    registry = CollectorRegistry()
    gauges = PlannerGauges(registry)
    d = DesiredCounts(PROFILE, SLO).update(obs(0, 40.0))
    gauges.publish(d, 1, 1)
    families = text_string_to_metric_families(render(registry))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    assert samples[("pdkv_planner_desired_engines", (("role", "prefill"),))] == d.prefill
    assert samples[("pdkv_planner_desired_engines", (("role", "decode"),))] == d.decode
    assert samples[("pdkv_planner_current_engines", (("role", "prefill"),))] == 1
    assert samples[("pdkv_planner_binding_slo", (("slo", d.binding),))] == 1
    assert sum(v for (name, _), v in samples.items() if name == "pdkv_planner_binding_slo") == 1
    assert samples[("pdkv_planner_predicted_seconds", (("slo", "ttft"),))] == pytest.approx(d.predicted_ttft_ms / 1000)


def test_gauges_published_from_many_threads_stay_whole():
    registry = CollectorRegistry()
    gauges = PlannerGauges(registry)
    decisions = [DesiredCounts(PROFILE, SLO).update(obs(0, r)) for r in (1.0, 40.0)]
    threads = [threading.Thread(target=lambda d=d: [gauges.publish(d, 1, 1) for _ in range(200)]) for d in decisions * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    text = render(registry)
    values = {s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "pdkv_planner_desired_engines"}
    assert values <= {decisions[0].prefill, decisions[0].decode, decisions[1].prefill, decisions[1].decode}

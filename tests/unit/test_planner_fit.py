from __future__ import annotations

import random

import msgspec
import pytest

from pdkv.errors import ConfigError, UsageError
from pdkv.planner.fit import fit_decode, fit_prefill, nonnegative_least_squares
from pdkv.planner.profile import DecodeRun, fits_from, load_profile, save_profile, unbatched_runs
from support.planner_profiles import make_profile


def test_exact_curve_is_recovered():
    bursts = [(n, c, 12.0 + 3.0 * c + 0.05 * c * n + 2e-5 * c * n * n) for n in (64, 256, 1024) for c in (1, 2, 8)]
    f = fit_prefill(bursts)
    assert (f.overhead_ms, f.ms_per_request, f.ms_per_token, f.ms_per_token_sq) == pytest.approx((12.0, 3.0, 0.05, 2e-5), rel=1e-6)
    assert f.rms_error_ms == pytest.approx(0, abs=1e-6) and f.points == 9


def test_a_requests_time_outside_the_engine_is_measured_apart_and_kept_out_of_ps_step():
    made = make_profile((10.0, 2.0, 0.05, 0.0), outside_ms=6.0)
    p, _ = fits_from(made.prefill, made.decode)
    assert p.outside_ms == pytest.approx(6.0)  # latency less P's own time, bursts of one request
    assert (p.overhead_ms, p.ms_per_request, p.ms_per_token) == pytest.approx((10.0, 2.0, 0.05), rel=1e-6)
    assert p.prompt_ms(1000) == pytest.approx(62.0) and p.alone_ms(1000) == pytest.approx(68.0)
    # Without the engine's own times (an older profile, or /metrics unread) it all counts as P's.
    unread = [msgspec.structs.replace(b, engine_ms=None) for b in made.prefill]
    q, _ = fits_from(unread, made.decode)
    assert q.outside_ms == 0.0 and q.prompt_ms(1000) == pytest.approx(68.0)


def test_a_burst_answered_in_several_forwards_pays_each_forwards_fixed_cost_not_each_requests():
    # The engine as vLLM runs a burst: the first prompt alone (the API server hands the rest over while it runs), then
    # the rest as the token budget allows, each forward paying the fixed 30 ms.
    def burst(n: int, c: int, budget: int = 4096) -> tuple[int, int, float, int]:
        per = budget // n  # prompts a forward takes
        forwards = [1] + [min(per, c - 1 - i) for i in range(0, c - 1, per)]  # prompts in each forward
        ms = sum(30.0 + 2.0 * k + 0.02 * k * n for k in forwards)
        return n, c, ms, len(forwards)

    seen = [burst(n, c) for n in (128, 1024, 2048) for c in (1, 2, 4, 8)]
    assert {s for *_, s in seen} == {1, 2, 3, 5}
    f = fit_prefill(seen)
    assert (f.overhead_ms, f.ms_per_request, f.ms_per_token) == pytest.approx((30.0, 2.0, 0.02), rel=1e-6)
    assert f.step_ms(4 * 1024, 4 * 1024 * 1024, 4) == pytest.approx(30.0 + 8.0 + 0.02 * 4096)  # four queued prompts, one forward
    # Taken as one forward each, the same bursts put later forwards' fixed costs on every request: four queued
    # prompts in one forward are predicted well over their time.
    one = fit_prefill([(n, c, ms) for n, c, ms, _ in seen])
    assert one.step_ms(4 * 1024, 4 * 1024 * 1024, 4) > 1.15 * f.step_ms(4 * 1024, 4 * 1024 * 1024, 4)


def test_noisy_decode_curve_lands_near_the_truth():
    rng = random.Random(1)
    points = [(b, b * t, (8.0 + 0.3 * b + 0.001 * b * t) * rng.uniform(0.97, 1.03)) for b in (1, 4, 16, 64) for t in (128, 1024)]
    d = fit_decode(points)
    assert d.base_ms == pytest.approx(8.0, rel=0.2)
    assert d.ms_per_seq == pytest.approx(0.3, rel=0.3)
    assert d.ms_per_kv_token == pytest.approx(0.001, rel=0.2)


def test_coefficients_never_go_negative():
    # Latency falling with prompt length is noise: the fit holds the slope at 0 instead of following it.
    f = fit_prefill([(100, 1, 50.0), (200, 1, 49.0), (400, 1, 48.0)])
    assert min(f.overhead_ms, f.ms_per_request, f.ms_per_token, f.ms_per_token_sq) >= 0
    assert f.step_ms(200) == pytest.approx(49.0) and f.ms_per_token == f.ms_per_token_sq == 0
    x, _ = nonnegative_least_squares([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [3.0, 2.0, 1.0])
    assert x[1] == 0 and x[0] == pytest.approx(2.0)


def test_one_point_fits_and_none_is_an_error():
    assert fit_prefill([(512, 1, 40.0)]).step_ms(512) == pytest.approx(40.0)
    with pytest.raises(UsageError):
        fit_prefill([])


def test_profile_round_trips_and_refits_to_its_own_curves(tmp_path):
    profile = make_profile((5.0, 0.0, 0.02, 1e-5), (15.0, 0.2, 0.0005), capacity=4096)
    path = tmp_path / "p.json"
    save_profile(profile, path)
    loaded = load_profile(path)
    assert loaded == profile
    p, d = fits_from(loaded.prefill, loaded.decode)
    assert p.step_ms(1000) == pytest.approx(profile.prefill_fit.step_ms(1000), rel=1e-6)
    assert d.itl_ms(8, 2000) == pytest.approx(profile.decode_fit.itl_ms(8, 2000), rel=1e-6)


@pytest.mark.parametrize(
    ("text", "words"),
    [("{", "not JSON"), ('{"version": 99}', "version 99"), ('{"created": 1}', "no valid version"), ('{"version": 1}', "")],
)
def test_bad_profiles_are_config_errors(tmp_path, text, words):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_profile(path)
    assert words in err.value.message
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


def test_runs_whose_streams_did_not_overlap_are_named():
    def run(batch: int, mean: float | None) -> DecodeRun:
        return DecodeRun(batch=batch, context_tokens=64, output_tokens=16, itl_ms=[1.0] * batch, mean_batch=mean)

    runs = [run(1, 1.0), run(2, 1.0), run(8, 1.0), run(8, 3.9), run(8, 4.0), run(16, None), run(4, 1.9)]
    assert [(r.batch, r.mean_batch) for r in unbatched_runs(runs)] == [(8, 1.0), (8, 3.9), (4, 1.9)]

"""A day of load through the simulator: the planner's signal against the best static xPyD for the same day (pure).

The day is a rate shape, not a measurement: `levels` gives the rate at each
of 24 equally spaced points as a share of the peak (by default a trough of
17% at 03:00-04:00, a ramp through the morning, a plateau at the peak from
late morning into the afternoon and a slower evening fall), linearly between
them, squeezed into `duration_s` simulated seconds.

The best static xPyD is the cheapest one whose day reaches the goal (by
default the planner's own attainment that day: "as good as the planner"),
searched for with the simulator itself: start from what `plan_capacity` asks
for at the peak rate; while the day's attainment is under the goal, add an
engine to the role whose target misses more; then bisect the fewest P, and
then the fewest D, that still reach it (attainment taken as monotone in each
count). Each point tried is one whole simulated day with the same seed (the
same arrivals).
"""

from __future__ import annotations

import msgspec

from pdkv.errors import UsageError
from pdkv.planner.capacity import plan_capacity
from pdkv.planner.profile import Profile
from pdkv.planner.signal import DesiredCounts, ScalePolicy
from pdkv.planner.simulate import SimConfig, SimResult, Simulation
from pdkv.planner.workload import Slo, Workload

DAY_LEVELS: tuple[float, ...] = (
    0.30, 0.24, 0.20, 0.17, 0.17, 0.20, 0.28, 0.42, 0.60, 0.78, 0.90, 0.97,
    1.00, 1.00, 0.98, 0.95, 0.90, 0.85, 0.80, 0.78, 0.72, 0.60, 0.48, 0.38,
)  # fmt: skip
MAX_GROWTH = 64  # engines the static search may add beyond the peak plan


class DayLoad(msgspec.Struct, frozen=True):
    peak_rate: float
    duration_s: float
    levels: tuple[float, ...] = DAY_LEVELS

    def check(self) -> None:
        if not self.peak_rate > 0 or not self.duration_s > 0:
            raise UsageError("the day needs a positive peak rate and duration")
        if len(self.levels) < 2 or min(self.levels) < 0 or max(self.levels) <= 0:
            raise UsageError("day levels need two or more shares of the peak, none negative, one above 0")

    def rate_at(self, t: float) -> float:
        n = len(self.levels)
        top = max(self.levels)
        x = (t / self.duration_s % 1.0) * n
        i = int(x)
        a, b = self.levels[i % n], self.levels[(i + 1) % n]
        return self.peak_rate * (a + (b - a) * (x - i)) / top

    def expected_requests(self) -> float:
        return self.peak_rate * self.duration_s * sum(self.levels) / len(self.levels) / max(self.levels)


class StaticTrial(msgspec.Struct, frozen=True):
    prefill: int
    decode: int
    attainment: float
    engine_hours: float


class DayComparison(msgspec.Struct, frozen=True):
    goal: float
    slo: Slo
    load: DayLoad
    planner: SimResult
    static_prefill: int
    static_decode: int
    static: SimResult
    static_meets_goal: bool
    tried: list[StaticTrial]


def _fewest(ok, lo: int, hi: int) -> int:
    """The least n in lo..hi with ok(n), given ok(hi)."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return hi


def simulate_static(profile: Profile, workload: Workload, slo: Slo, load: DayLoad, config: SimConfig, prefill: int,
                    decode: int) -> SimResult:  # fmt: skip
    """One day with `prefill` P and `decode` D serving from the start to the end."""
    return Simulation(profile, workload, slo, load.rate_at, load.peak_rate, config, prefill, decode).run()


def simulate_planner(profile: Profile, workload: Workload, slo: Slo, load: DayLoad, config: SimConfig,
                     policy: ScalePolicy) -> SimResult:  # fmt: skip
    """One day with the signal choosing the counts, starting from what the plan asks for at the first rate."""
    first = plan_capacity(profile, workload.at_rate(max(load.rate_at(0.0), 1e-6)), slo,
                          max_engines=max(policy.max_prefill, policy.max_decode))  # fmt: skip
    p = min(max(first.prefill_engines, policy.min_prefill), policy.max_prefill)
    d = min(max(first.decode_engines, policy.min_decode), policy.max_decode)
    signal = DesiredCounts(profile, slo, policy)
    return Simulation(profile, workload, slo, load.rate_at, load.peak_rate, config, p, d, signal).run()


def compare_day(profile: Profile, workload: Workload, slo: Slo, load: DayLoad, config: SimConfig, policy: ScalePolicy,
                goal: float | None = None) -> DayComparison:  # fmt: skip
    """The planner's day beside the cheapest static xPyD whose attainment reaches `goal` (None: the planner's)."""
    load.check()
    if goal is not None and not 0 < goal <= 1:
        raise UsageError(f"the attainment goal must lie in (0, 1], got {goal}")
    planner = simulate_planner(profile, workload, slo, load, config, policy)
    goal = planner.attainment if goal is None else goal
    runs: dict[tuple[int, int], SimResult] = {}

    def run(p: int, d: int) -> SimResult:
        if (p, d) not in runs:
            runs[(p, d)] = simulate_static(profile, workload, slo, load, config, p, d)
        return runs[(p, d)]

    peak = plan_capacity(profile, workload.at_rate(load.peak_rate), slo, max_engines=max(policy.max_prefill, policy.max_decode))
    p = min(max(peak.prefill_engines, policy.min_prefill), policy.max_prefill)
    d = min(max(peak.decode_engines, policy.min_decode), policy.max_decode)
    for _ in range(MAX_GROWTH):
        r = run(p, d)
        if r.attainment >= goal:
            break
        grow_p = r.ttft_attainment <= r.itl_attainment
        if grow_p and p < policy.max_prefill:
            p += 1
        elif d < policy.max_decode:
            d += 1
        elif p < policy.max_prefill:
            p += 1
        else:
            break
    if run(p, d).attainment >= goal:
        p = _fewest(lambda n: run(n, d).attainment >= goal, policy.min_prefill, p)
        d = _fewest(lambda n: run(p, n).attainment >= goal, policy.min_decode, d)
    best = run(p, d)
    tried = [StaticTrial(tp, td, r.attainment, r.engine_hours) for (tp, td), r in runs.items()]
    return DayComparison(goal=goal, slo=slo, load=load, planner=planner, static_prefill=p, static_decode=d, static=best,
                         static_meets_goal=best.attainment >= goal, tried=tried)  # fmt: skip

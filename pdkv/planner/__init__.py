"""Capacity planning against latency targets: profiles of running engines, the queueing arithmetic that turns a
profile and a workload into P and D counts, the desired-count signal with hysteresis, the observation it reads and its gauges, and a fleet
simulator. docs/planner.md has the models."""

from pdkv.planner.capacity import Plan, Prediction, plan_capacity, predict
from pdkv.planner.day import DAY_LEVELS, DayComparison, DayLoad, compare_day
from pdkv.planner.fit import DecodeFit, PrefillFit, fit_decode, fit_prefill
from pdkv.planner.gauges import PlannerGauges
from pdkv.planner.measure import ProfileSettings, measure_profile, run_profile
from pdkv.planner.profile import PROFILE_VERSION, Profile, load_profile, median, save_profile, unbatched_runs
from pdkv.planner.signal import Desired, DesiredCounts, Observation, ScalePolicy
from pdkv.planner.simulate import SimConfig, SimResult, Simulation
from pdkv.planner.window import RequestSample, observe_window
from pdkv.planner.workload import Slo, Workload, load_trace, make_workload, parse_lengths, parse_slo

__all__ = [
    "DAY_LEVELS",
    "DayComparison",
    "DayLoad",
    "DecodeFit",
    "Desired",
    "DesiredCounts",
    "Observation",
    "PROFILE_VERSION",
    "Plan",
    "PlannerGauges",
    "Prediction",
    "PrefillFit",
    "Profile",
    "ProfileSettings",
    "RequestSample",
    "ScalePolicy",
    "SimConfig",
    "SimResult",
    "Simulation",
    "Slo",
    "Workload",
    "compare_day",
    "fit_decode",
    "fit_prefill",
    "load_profile",
    "load_trace",
    "make_workload",
    "measure_profile",
    "median",
    "observe_window",
    "parse_lengths",
    "parse_slo",
    "plan_capacity",
    "predict",
    "run_profile",
    "save_profile",
    "unbatched_runs",
]

"""Capacity planning against latency targets: profiles of running engines, the queueing arithmetic that turns a
profile and a workload into P and D counts, the desired-count signal with hysteresis, and a fleet simulator."""

from pdkv.planner.fit import DecodeFit, PrefillFit, fit_decode, fit_prefill
from pdkv.planner.profile import PROFILE_VERSION, Profile, load_profile, save_profile

__all__ = [
    "PROFILE_VERSION",
    "DecodeFit",
    "PrefillFit",
    "Profile",
    "fit_decode",
    "fit_prefill",
    "load_profile",
    "save_profile",
]

"""The planner's Prometheus gauges (prometheus_client), for whatever process runs the signal (the proxy, later).

    pdkv_planner_desired_engines{role}      engines the signal asks for (prefill, decode)
    pdkv_planner_current_engines{role}      engines serving now
    pdkv_planner_binding_slo{slo}           1 for the target that binds at the desired counts (ttft, itl, kv, none), else 0
    pdkv_planner_predicted_seconds{slo}     the model's TTFT and ITL at the targets' quantile, at the desired counts

A HorizontalPodAutoscaler or KEDA reads the first through the Prometheus
adapter; `binding_slo` says why. Gauges live on a registry the caller owns
(pdkv.metrics: never the global one).
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Gauge

from pdkv.planner.signal import ROLES, Desired

BINDINGS = ("ttft", "itl", "kv", "none")


class PlannerGauges:
    """The gauges on `registry`. `publish` is called from the one loop that runs the signal."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.desired = Gauge("pdkv_planner_desired_engines", "Engines the planner asks for, per role.", ["role"], registry=registry)
        self.current = Gauge("pdkv_planner_current_engines", "Engines serving now, per role.", ["role"], registry=registry)
        self.binding = Gauge("pdkv_planner_binding_slo", "1 for the target that binds at the desired counts, else 0.", ["slo"],
                             registry=registry)  # fmt: skip
        self.predicted = Gauge("pdkv_planner_predicted_seconds", "Predicted TTFT and ITL at the targets' quantile, desired counts.",
                               ["slo"], registry=registry)  # fmt: skip
        for role in ROLES:
            self.desired.labels(role)
            self.current.labels(role)
        for slo in BINDINGS:
            self.binding.labels(slo)

    def publish(self, desired: Desired, current_prefill: int, current_decode: int) -> None:
        self.desired.labels("prefill").set(desired.prefill)
        self.desired.labels("decode").set(desired.decode)
        self.current.labels("prefill").set(current_prefill)
        self.current.labels("decode").set(current_decode)
        for slo in BINDINGS:
            self.binding.labels(slo).set(1 if slo == desired.binding else 0)
        for slo, ms in (("ttft", desired.predicted_ttft_ms), ("itl", desired.predicted_itl_ms)):
            self.predicted.labels(slo).set(ms / 1000 if math.isfinite(ms) else math.inf)

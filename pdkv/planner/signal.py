"""The desired number of P and D engines, from what a running deployment observes, with hysteresis (pure).

Every few seconds the caller hands `DesiredCounts.update` an `Observation`
(arrival rate, prompt and output lengths, P's queue, observed TTFT and ITL,
the engines serving now) and gets a `Desired` back. Per role:

- need: the counts `plan_capacity` gives for the observed workload against
  the targets, raised where what is observed says the model is short: P's
  queue holds more work than the TTFT target (waiting x mean prefill, spread
  over P) or the role's observed latency is over its target while the plan
  says the current count is enough (then one more than now);
- keep: the counts that would keep predicted latencies under `down_margin`
  x the targets (a band below the targets, so a count met only just is not
  given up), never fewer than serve now while the role's observed latency
  is above that band (the model may be kinder than the engines), and never
  fewer than need.

Up: when need exceeds the desired count for `up_after_s`, desired jumps to
need at once. Down: when keep stays below desired for `down_after_s`,
desired falls to the highest keep seen over that wait (what would have
sufficed all along it, as Kubernetes' HPA stabilizes a scale-down), and the
wait starts again. One engine at a time would take hours to bring a fleet of
hundreds back after a burst.
Between keep and need nothing moves: that band, and the asymmetric waits,
are the hysteresis. Desired stays within the policy's min and max.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from pdkv.errors import UsageError
from pdkv.planner.capacity import Binding, binding_of, plan_capacity, predict
from pdkv.planner.profile import Profile
from pdkv.planner.workload import Slo, Workload

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")


class ScalePolicy(msgspec.Struct, frozen=True, kw_only=True):
    min_prefill: int = 1
    max_prefill: int = 256
    min_decode: int = 1
    max_decode: int = 256
    down_margin: float = 0.8  # a smaller count must predict latencies under this share of the targets
    down_after_s: float = 60.0  # ... for this long before engines are let go
    up_after_s: float = 0.0  # a larger need must last this long before it is asked for (0: at once)

    def bounds(self, role: Role) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role == "prefill" else (self.min_decode, self.max_decode)

    def check(self) -> None:
        for role in ROLES:
            lo, hi = self.bounds(role)
            if not 1 <= lo <= hi:
                raise UsageError(f"{role} bounds must satisfy 1 <= min <= max, got {lo}..{hi}")
        if not 0 < self.down_margin <= 1 or self.down_after_s < 0 or self.up_after_s < 0:
            raise UsageError("down_margin must lie in (0, 1]; down_after_s and up_after_s must not be negative")


class Observation(msgspec.Struct, frozen=True, kw_only=True):
    at_s: float  # a monotonic clock, seconds
    rate: float  # requests per second arriving, over the caller's window
    prompt_tokens: list[int]  # lengths seen in the window (or a sample of them)
    output_tokens: list[int]
    prefill_engines: int  # serving now
    decode_engines: int
    prefill_waiting: float = 0.0  # requests queued on all P together (vllm:num_requests_waiting)
    ttft_ms: float | None = None  # observed at the targets' quantile over the window; None when too few requests
    itl_ms: float | None = None


class Desired(msgspec.Struct, frozen=True):
    prefill: int
    decode: int
    binding: Binding  # the target with the least headroom at the desired counts
    need_prefill: int
    need_decode: int
    keep_prefill: int
    keep_decode: int
    predicted_ttft_ms: float
    predicted_itl_ms: float


def _counts(profile: Profile, workload: Workload, slo: Slo, cap: int) -> tuple[int, int]:
    if workload.rate <= 0:
        return 1, 1
    plan = plan_capacity(profile, workload, slo, max_engines=cap)
    return plan.prefill_engines, plan.decode_engines


class DesiredCounts:
    """The hysteresis state. Owned by one caller (the loop that calls `update`); not for several threads."""

    def __init__(self, profile: Profile, slo: Slo, policy: ScalePolicy | None = None) -> None:
        self.profile, self.slo = profile, slo
        self.policy = policy or ScalePolicy()
        self.policy.check()
        self._desired: dict[Role, int] | None = None
        self._up_since: dict[Role, float | None] = dict.fromkeys(ROLES)
        self._down_since: dict[Role, float | None] = dict.fromkeys(ROLES)
        self._keep_high: dict[Role, int] = dict.fromkeys(ROLES, 0)  # the highest keep since _down_since

    def _clamp(self, role: Role, n: int) -> int:
        lo, hi = self.policy.bounds(role)
        return min(hi, max(lo, n))

    def needs(self, obs: Observation) -> tuple[dict[Role, int], dict[Role, int]]:
        """(need, keep) per role for one observation, before hysteresis."""
        cap = max(self.policy.max_prefill, self.policy.max_decode)
        prompts = obs.prompt_tokens or [1]
        outputs = obs.output_tokens or [1]
        workload = Workload(rate=max(0.0, obs.rate), prompt_tokens=prompts, output_tokens=outputs)
        p, d = _counts(self.profile, workload, self.slo, cap)
        margin = self.policy.down_margin
        kp, kd = _counts(self.profile, workload, Slo(self.slo.ttft_ms * margin, self.slo.itl_ms * margin, self.slo.quantile), cap)
        mean_prefill_ms = sum(self.profile.prefill_fit.prompt_ms(n) for n in prompts) / len(prompts)
        backlog = math.ceil(obs.prefill_waiting * mean_prefill_ms / self.slo.ttft_ms) if obs.prefill_waiting > 0 else 0
        p = max(p, backlog)
        if obs.ttft_ms is not None and obs.ttft_ms > self.slo.ttft_ms and p <= obs.prefill_engines:
            p = obs.prefill_engines + 1
        if obs.itl_ms is not None and obs.itl_ms > self.slo.itl_ms and d <= obs.decode_engines:
            d = obs.decode_engines + 1
        need = {"prefill": self._clamp("prefill", p), "decode": self._clamp("decode", d)}
        if obs.ttft_ms is not None and obs.ttft_ms > self.slo.ttft_ms * margin:
            kp = max(kp, obs.prefill_engines)
        if obs.itl_ms is not None and obs.itl_ms > self.slo.itl_ms * margin:
            kd = max(kd, obs.decode_engines)
        # Never keep fewer than are needed: an observed latency over its target raises need above what the model
        # keeps, and without this the count asked for would be let go while its engine still starts.
        keep = {"prefill": self._clamp("prefill", max(kp, backlog, p)), "decode": self._clamp("decode", max(kd, d))}
        return need, keep

    def update(self, obs: Observation) -> Desired:
        need, keep = self.needs(obs)
        if self._desired is None:
            self._desired = {"prefill": self._clamp("prefill", obs.prefill_engines), "decode": self._clamp("decode", obs.decode_engines)}
        for role in ROLES:
            current = self._desired[role]
            if need[role] > current:
                since = self._up_since[role]
                since = self._up_since[role] = obs.at_s if since is None else since
                if obs.at_s - since >= self.policy.up_after_s:
                    self._desired[role] = need[role]
                    self._up_since[role] = None
                self._down_since[role] = None
                continue
            self._up_since[role] = None
            if keep[role] < current:
                since = self._down_since[role]
                if since is None:
                    since = self._down_since[role] = obs.at_s
                    self._keep_high[role] = keep[role]
                self._keep_high[role] = max(self._keep_high[role], keep[role])
                if obs.at_s - since >= self.policy.down_after_s:
                    self._desired[role] = self._keep_high[role]
                    self._down_since[role] = None
            else:
                self._down_since[role] = None
        dp, dd = self._desired["prefill"], self._desired["decode"]
        workload = Workload(rate=max(obs.rate, 1e-9), prompt_tokens=obs.prompt_tokens or [1], output_tokens=obs.output_tokens or [1])
        pred = predict(self.profile, workload, dp, dd, self.slo.quantile)
        binding: Binding = "none" if obs.rate <= 0 and pred.kv_fits else binding_of(pred, self.slo)[0]
        return Desired(dp, dd, binding, need["prefill"], need["decode"], keep["prefill"], keep["decode"], pred.ttft_ms, pred.itl_ms)

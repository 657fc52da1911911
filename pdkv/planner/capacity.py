"""How many P and D engines a workload needs to meet its latency targets (pure arithmetic; docs/planner.md).

Prefill: each P is a G/G/1 queue. Requests arrive as a Poisson stream and
the proxy deals them out round-robin, so each of n_P engines sees every
n_P-th arrival: Erlang inter-arrival times of squared coefficient of
variation c_a^2 = 1/n_P. One prompt of L tokens is served in S(L) = the
profile's prefill step for that prompt alone (c_s^2 its squared coefficient
of variation over the prompt lengths). The mean wait is Kingman's,
E[W] = (c_a^2 + c_s^2)/2 * rho/(1 - rho) * E[S], which for one engine
(Poisson arrivals) is Pollaczek-Khinchine's exactly; the wait's distribution
is taken as an atom at 0 of mass 1 - rho and an exponential tail of mean
E[W]/rho beyond it (exact for M/M/1, the usual approximation beyond). A
request's own service is independent of its wait (FCFS), so
TTFT = W + S(L) + handover + D's first step, and its quantile is solved for
over the prompt-length samples. Serving prompts one at a time ignores the
batching P does when a queue forms: the model is conservative under load,
which the simulator (which batches) shows.

Decode: each D is an infinite-server queue while its KV holds the batch
(continuous batching admits every request at once). By Little's law it holds
on average m = (rate/n_D) * E[output] * ITL(m) / 1000 sequences, with
ITL(B) the profile's decode step for B sequences of KV k = E[prompt] +
E[output]/2 each: m = r d0 / (1 - r (d1 + d2 k)), r = rate/n_D * E[output]/1000.
The number running is Poisson with mean m (M/G/inf), so the ITL quantile
is the step at the Poisson quantile of the batch, and KV must hold the
batch's 99th percentile of full-length sequences (E[prompt] + E[output] each).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import msgspec

from pdkv.planner.profile import Profile
from pdkv.planner.workload import Slo, Workload

Binding = Literal["ttft", "itl", "kv", "none"]
KV_QUANTILE = 0.99
MAX_ENGINES = 256


class RolePrediction(msgspec.Struct, frozen=True):
    engines: int
    utilization: float  # P: rho; D: mean running sequences / what KV holds (0 when the capacity is unknown)
    latency_ms: float  # P: TTFT at the quantile; D: ITL at the quantile (inf when it cannot keep up)
    mean_batch: float = 0.0  # D only


class Prediction(msgspec.Struct, frozen=True):
    prefill: RolePrediction
    decode: RolePrediction
    ttft_ms: float
    itl_ms: float
    kv_fits: bool
    kv_share: float = 0.0  # the KV D needs at its 99th-percentile batch / what it holds (0: capacity unknown)


class Plan(msgspec.Struct, frozen=True):
    """The fewest engines per role meeting `slo` for `workload`, or `feasible` False with `reason`."""

    feasible: bool
    prefill_engines: int
    decode_engines: int
    binding: Binding  # the target with the least headroom at these counts
    binding_role: Literal["prefill", "decode", "none"]
    prediction: Prediction
    slo: Slo
    rate: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    reason: str = ""


def _poisson_quantile(mean: float, q: float) -> int:
    """The smallest k with P(N <= k) >= q for N ~ Poisson(mean) (a normal tail past 700, where exp underflows)."""
    if mean <= 0:
        return 0
    if mean > 700:
        z = math.sqrt(2) * _erfinv(2 * q - 1)
        return max(0, math.ceil(mean + z * math.sqrt(mean)))
    k, term = 0, math.exp(-mean)
    total = term
    while total < q:
        k += 1
        term *= mean / k
        total += term
    return k


def _erfinv(y: float) -> float:
    lo, hi = -6.0, 6.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
    return (lo + hi) / 2


def decode_batch(profile: Profile, workload: Workload, engines: int) -> float:
    """Mean sequences running on one D (Little's law fixed point); inf when D cannot keep up at any batch."""
    d = profile.decode_fit
    k = workload.mean_prompt + workload.mean_output / 2
    r = workload.rate / engines * workload.mean_output / 1000
    slope = r * (d.ms_per_seq + d.ms_per_kv_token * k)
    return math.inf if slope >= 1 else r * d.base_ms / (1 - slope)


def predict_decode(profile: Profile, workload: Workload, engines: int, q: float) -> tuple[RolePrediction, float]:
    """D's prediction and its KV share (the KV its 99th-percentile batch needs / what it holds; 0: unknown)."""
    m = decode_batch(profile, workload, engines)
    if math.isinf(m):
        return RolePrediction(engines, math.inf, math.inf, math.inf), math.inf
    k = workload.mean_prompt + workload.mean_output / 2
    b = max(1, _poisson_quantile(m, q))
    itl = profile.decode_fit.itl_ms(b, b * k)
    capacity = profile.model.kv_capacity_tokens
    full = workload.mean_prompt + workload.mean_output
    share = _poisson_quantile(m, KV_QUANTILE) * full / capacity if capacity else 0.0
    usage = m * full / capacity if capacity else 0.0
    return RolePrediction(engines, usage, itl, m), share


def _quantile(cdf: Callable[[float], float], q: float, hi: float) -> float:
    lo = 0.0
    while cdf(hi) < q:
        lo, hi = hi, hi * 2
        if hi > 1e12:
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return hi


def predict_prefill(profile: Profile, workload: Workload, engines: int, q: float, extra_ms: float) -> RolePrediction:
    """TTFT at quantile `q` with `engines` P (G/G/1 each, round-robin arrivals, served for the engine's time); each
    request's time outside the engine and `extra_ms` (handover, D's first step) are added to every request."""
    f = profile.prefill_fit
    service = [f.prompt_ms(n) / 1000 for n in workload.prompt_tokens]
    lam = workload.rate / engines
    es = sum(service) / len(service)
    es2 = sum(s * s for s in service) / len(service)
    rho = lam * es
    if rho >= 1:
        return RolePrediction(engines, rho, math.inf)
    cs2 = es2 / (es * es) - 1
    wait = (1 / engines + cs2) / 2 * rho / (1 - rho) * es
    tail = wait / rho if rho > 0 else 0.0

    def cdf(t: float) -> float:
        total = 0.0
        for s in service:
            if t >= s:
                total += 1 - (rho * math.exp(-(t - s) / tail) if tail > 0 else 0.0)
        return total / len(service)

    t = _quantile(cdf, q, max(service) + 10 * tail + 1e-3)
    return RolePrediction(engines, rho, t * 1000 + f.outside_ms + extra_ms)


def predict(profile: Profile, workload: Workload, prefill_engines: int, decode_engines: int, q: float) -> Prediction:
    """Predicted TTFT and ITL at quantile `q` for a given number of P and D engines."""
    dec, kv_share = predict_decode(profile, workload, decode_engines, q)
    first_step = profile.decode_fit.itl_ms(max(1.0, dec.mean_batch), max(1.0, dec.mean_batch) * workload.mean_prompt)
    pre = predict_prefill(profile, workload, prefill_engines, q, profile.handover_ms + first_step)
    return Prediction(prefill=pre, decode=dec, ttft_ms=pre.latency_ms, itl_ms=dec.latency_ms, kv_fits=kv_share <= 1.0,
                      kv_share=kv_share)


def _fewest(ok: Callable[[int], bool], max_engines: int) -> int | None:
    """The least n in 1..max_engines with ok(n), ok being monotone; None when even max_engines is not enough."""
    if not ok(max_engines):
        return None
    lo, hi = 1, max_engines
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def binding_of(pred: Prediction, slo: Slo) -> tuple[Binding, Literal["prefill", "decode", "none"]]:
    """The target with the least headroom: the largest of TTFT / its target, ITL / its target and D's KV share."""
    ttft, itl, kv = pred.ttft_ms / slo.ttft_ms, pred.itl_ms / slo.itl_ms, pred.kv_share
    if kv >= max(ttft, itl):
        return "kv", "decode"
    return ("ttft", "prefill") if ttft >= itl else ("itl", "decode")


def plan_capacity(profile: Profile, workload: Workload, slo: Slo, *, max_engines: int = MAX_ENGINES) -> Plan:
    """The fewest D meeting the ITL target (and holding the KV), then the fewest P meeting TTFT beside them."""
    q = slo.quantile
    common = dict(slo=slo, rate=workload.rate, mean_prompt_tokens=workload.mean_prompt, mean_output_tokens=workload.mean_output)

    def d_ok(n: int) -> bool:
        dec, kv_share = predict_decode(profile, workload, n, q)
        return kv_share <= 1.0 and dec.latency_ms <= slo.itl_ms

    n_d = _fewest(d_ok, max_engines)
    if n_d is None:
        alone = profile.decode_fit.itl_ms(1, workload.mean_prompt + workload.mean_output / 2)
        pred = predict(profile, workload, max_engines, max_engines, q)
        why = (f"one sequence alone decodes at {alone:.1f} ms per token, over the {slo.itl_ms:g} ms target" if alone > slo.itl_ms
               else f"even {max_engines} D engines do not meet ITL {slo.itl_ms:g} ms (or hold the KV)")  # fmt: skip
        return Plan(False, max_engines, max_engines, *binding_of(pred, slo), pred, reason=why, **common)
    n_p = _fewest(lambda n: predict(profile, workload, n, n_d, q).ttft_ms <= slo.ttft_ms, max_engines)
    if n_p is None:
        pred = predict(profile, workload, max_engines, n_d, q)
        longest = profile.prefill_fit.alone_ms(max(workload.prompt_tokens))
        why = (f"the longest prompt alone takes {longest:.0f} ms on P, over the {slo.ttft_ms:g} ms TTFT target" if longest > slo.ttft_ms
               else f"even {max_engines} P engines do not meet TTFT {slo.ttft_ms:g} ms")  # fmt: skip
        return Plan(False, max_engines, n_d, "ttft", "prefill", pred, reason=why, **common)
    pred = predict(profile, workload, n_p, n_d, q)
    return Plan(True, n_p, n_d, *binding_of(pred, slo), pred, **common)

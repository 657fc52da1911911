"""Least-squares curves through a profile's measurements (pure; no numpy, so `pip install pdkv` plans too).

Prefill, one forward of a batch of k prompts of L_i tokens:

    step_ms = overhead_ms + ms_per_request * k + ms_per_token * sum(L_i) + ms_per_token_sq * sum(L_i^2)

the fixed cost of a forward, what each request costs beside its tokens
(scheduling, sampling), the linear layers, and attention's quadratic part.
A burst of c prompts of L tokens sent at once is observed as its makespan
(the last answer): the s forwards P took for it, back to back, so s fixed
costs and each prompt's own, plus `outside_ms`: a request's time outside
the engine (the HTTP exchange, the API server's work before and after the
engine; large on a CPU host), which is in its TTFT but does not hold P's
engine, so under load it overlaps other requests' forwards. A single
prompt is the case c = s = 1. The count s is P's own (its steps during the
burst, from its /metrics): the API server hands a burst's prompts to the
engine one by one, so the first is often forwarded alone, and a token
budget splits the rest. Taken as one forward (s = 1, the count unknown),
the later forwards' fixed costs are charged to each request, and a queue
under load, batched in fewer forwards than that implies, is predicted slower
than it runs.

Decode, one step of a running batch of B sequences holding T tokens of KV:

    itl_ms = base_ms + ms_per_seq * B + ms_per_kv_token * T

Both are fitted with non-negative coefficients: a negative per-token cost
is noise, not physics, and would let the planner predict faster prefills
for longer prompts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import msgspec

from pdkv.errors import UsageError


class PrefillFit(msgspec.Struct, frozen=True):
    """step_ms = overhead_ms + ms_per_request * k + ms_per_token * sum(L) + ms_per_token_sq * sum(L^2), P's engine;
    a request's TTFT adds `outside_ms`, its time outside the engine (0 in profiles that did not measure it)."""

    overhead_ms: float
    ms_per_request: float
    ms_per_token: float
    ms_per_token_sq: float
    rms_error_ms: float = 0.0
    points: int = 0
    outside_ms: float = 0.0

    def step_ms(self, tokens: float, tokens_sq: float | None = None, requests: float = 1) -> float:
        """One forward over `requests` prompts totalling `tokens`, `tokens_sq` the sum of their squares (one prompt: tokens^2)."""
        sq = tokens * tokens if tokens_sq is None else tokens_sq
        return self.overhead_ms + self.ms_per_request * requests + self.ms_per_token * tokens + self.ms_per_token_sq * sq

    def prompt_ms(self, prompt_tokens: float) -> float:
        """One prompt alone on an idle engine: the engine's time, what the prompt holds P for."""
        return self.step_ms(prompt_tokens)

    def alone_ms(self, prompt_tokens: float) -> float:
        """One prompt alone, as its client sees it: the engine's time and the time outside it."""
        return self.step_ms(prompt_tokens) + self.outside_ms


class DecodeFit(msgspec.Struct, frozen=True):
    """itl_ms = base_ms + ms_per_seq * batch + ms_per_kv_token * kv_tokens."""

    base_ms: float
    ms_per_seq: float
    ms_per_kv_token: float
    rms_error_ms: float = 0.0
    points: int = 0

    def itl_ms(self, batch: float, kv_tokens: float) -> float:
        return self.base_ms + self.ms_per_seq * batch + self.ms_per_kv_token * kv_tokens


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when the system is singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for row in m for v in row[:-1])):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def nonnegative_least_squares(rows: Sequence[Sequence[float]], y: Sequence[float]) -> tuple[list[float], float]:
    """Coefficients >= 0 minimising the squared error of rows @ x against y, and the RMS error.

    Exhaustive over which coefficients are free (the rest held at 0): with four
    columns that is fifteen small solves, exact, and needs no iteration to converge.
    Columns are scaled to unit norm first, so tokens and tokens squared solve alike.
    """
    if not rows or len(rows) != len(y):
        raise UsageError("nothing to fit: no measurements")
    k = len(rows[0])
    norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in range(k)]
    scaled = [[r[j] / norms[j] for j in range(k)] for r in rows]
    best: tuple[float, list[float]] | None = None
    for size in range(k, 0, -1):
        for free in itertools.combinations(range(k), size):
            ata = [[sum(r[i] * r[j] for r in scaled) for j in free] for i in free]
            aty = [sum(r[i] * yy for r, yy in zip(scaled, y, strict=True)) for i in free]
            sol = _solve(ata, aty)
            if sol is None or any(v < 0 for v in sol):
                continue
            x = [0.0] * k
            for i, v in zip(free, sol, strict=True):
                x[i] = v
            sse = sum((sum(r[j] * x[j] for j in range(k)) - yy) ** 2 for r, yy in zip(scaled, y, strict=True))
            if best is None or sse < best[0] - 1e-12:
                best = (sse, x)
    if best is None:
        return [0.0] * k, math.sqrt(sum(v * v for v in y) / len(y))
    sse, x = best
    return [x[j] / norms[j] for j in range(k)], math.sqrt(sse / len(y))


def fit_prefill(bursts: Sequence[tuple[int, int, float] | tuple[int, int, float, int]], outside_ms: float = 0.0) -> PrefillFit:
    """Fit PrefillFit to bursts of (prompt_tokens, concurrency, makespan_ms[, steps]), `outside_ms` of each makespan
    being time outside the engine (measured apart: pdkv.planner.profile.outside_ms); `steps` the forwards P took for
    the burst (one when not given)."""
    seen = [(b[0], b[1], b[2], b[3] if len(b) > 3 else 1) for b in bursts]  # (tokens, concurrency, makespan, forwards)
    rows = [[float(steps), float(c), float(c * n), float(c * n * n)] for n, c, _, steps in seen]
    (a, r, b, q), rms = nonnegative_least_squares(rows, [max(0.0, ms - outside_ms) for _, _, ms, _ in seen])
    return PrefillFit(overhead_ms=a, ms_per_request=r, ms_per_token=b, ms_per_token_sq=q, rms_error_ms=rms, points=len(bursts),
                      outside_ms=outside_ms)


def fit_decode(points: Sequence[tuple[float, float, float]]) -> DecodeFit:
    """Fit DecodeFit to points of (batch, kv_tokens, itl_ms)."""
    rows = [[1.0, float(b), float(t)] for b, t, _ in points]
    (d0, d1, d2), rms = nonnegative_least_squares(rows, [ms for _, _, ms in points])
    return DecodeFit(base_ms=d0, ms_per_seq=d1, ms_per_kv_token=d2, rms_error_ms=rms, points=len(points))

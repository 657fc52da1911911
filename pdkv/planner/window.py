"""An `Observation` from what a proxy saw over a sliding window (pure; the clock is the caller's).

The proxy keeps one `RequestSample` per finished request. Over the last
`window_s` seconds:

- rate: the requests that arrived in the window, over the window's length
  (or over the time since the first sample, while the proxy is younger than
  the window, so a new proxy does not read a burst as a trickle);
- prompt and output lengths: those of the window's requests;
- TTFT and ITL: the targets' quantile over the window's requests that have
  them, None with fewer than `min_samples` (a quantile of two requests is
  noise, and the signal then follows its model alone).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from pdkv.planner.signal import Observation

MIN_SAMPLES = 3


class RequestSample(msgspec.Struct, frozen=True):
    """One finished request as the planner needs it; times in seconds on the caller's clock."""

    at_s: float  # when it arrived
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None  # arrival to first token (None: not known for this request)
    itl_s: float | None = None  # mean time between its output tokens (None: one token, or not streamed)


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank, as the targets are read: p90 of 10 values is the 9th)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def observe_window(
    samples: Iterable[RequestSample], *, now_s: float, window_s: float, quantile_q: float, prefill_engines: int,
    decode_engines: int, prefill_waiting: float = 0.0, since_s: float | None = None, min_samples: int = MIN_SAMPLES,
) -> Observation:
    """The Observation of the samples that arrived in (now_s - window_s, now_s]. `since_s`: when observing began
    (the rate's denominator is never longer than the time since then)."""
    start = now_s - window_s
    recent = [s for s in samples if start < s.at_s <= now_s]
    span = window_s if since_s is None else max(1e-3, min(window_s, now_s - since_s))
    ttfts = [s.ttft_s * 1000 for s in recent if s.ttft_s is not None]
    itls = [s.itl_s * 1000 for s in recent if s.itl_s is not None]
    return Observation(
        at_s=now_s,
        rate=len(recent) / span,
        prompt_tokens=[s.prompt_tokens for s in recent if s.prompt_tokens > 0],
        output_tokens=[s.output_tokens for s in recent if s.output_tokens > 0],
        prefill_engines=prefill_engines,
        decode_engines=decode_engines,
        prefill_waiting=max(0.0, prefill_waiting),
        ttft_ms=quantile(ttfts, quantile_q) if len(ttfts) >= min_samples else None,
        itl_ms=quantile(itls, quantile_q) if len(itls) >= min_samples else None,
    )

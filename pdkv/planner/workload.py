"""What the planner plans for: a request rate, the lengths of prompts and outputs, and the latency targets.

Lengths are kept as equally likely samples of their distribution: a fixed
length is one sample, a range `A-B` is evenly spaced quantiles of the
uniform distribution on it, a list `A,B,C` is itself, and a trace file
(JSON lines, one request each, with `prompt_tokens` and `output_tokens`, and
optionally `timestamp` in seconds) gives every request's pair and, from its
timestamps, the rate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec

from pdkv.errors import ConfigError, UsageError

RANGE_SAMPLES = 64


class Slo(msgspec.Struct, frozen=True):
    """Targets at one quantile (0.9: p90) of time to first token and inter-token latency."""

    ttft_ms: float
    itl_ms: float
    quantile: float = 0.9


class Workload(msgspec.Struct, frozen=True):
    rate: float  # requests per second, all engines together
    prompt_tokens: list[int]  # equally likely samples
    output_tokens: list[int]

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompt_tokens) / len(self.prompt_tokens)

    @property
    def mean_output(self) -> float:
        return sum(self.output_tokens) / len(self.output_tokens)

    def at_rate(self, rate: float) -> Workload:
        return Workload(rate=rate, prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens)


def parse_lengths(text: str, flag: str) -> list[int]:
    """`1000`, `200-2000` (uniform) or `128,512,2048` (equally likely) as samples."""
    text = text.strip()
    try:
        if "-" in text:
            lo, hi = (int(v) for v in text.split("-", 1))
            if lo > hi:
                lo, hi = hi, lo
            return sorted({round(lo + (hi - lo) * (i + 0.5) / RANGE_SAMPLES) for i in range(RANGE_SAMPLES)})
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes N, A-B or A,B,C (token counts), got {text!r}") from None
    if not values or min(values) <= 0:
        raise UsageError(f"{flag} needs positive token counts, got {text!r}")
    return values


def parse_slo(text: str, quantile: float = 0.9) -> Slo:
    """`ttft=500,itl=50` (milliseconds) as an Slo."""
    fields: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower().removesuffix("_ms").removesuffix("_p90")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or key not in ("ttft", "itl") or not number > 0:
            raise UsageError(f"--slo takes ttft=MS,itl=MS (positive milliseconds), got {text!r}")
        fields[key] = number
    if set(fields) != {"ttft", "itl"}:
        raise UsageError(f"--slo needs both ttft and itl targets, got {text!r}", hint="e.g. --slo ttft=500,itl=50")
    if not 0 < quantile < 1:
        raise UsageError(f"--quantile must lie between 0 and 1, got {quantile}")
    return Slo(ttft_ms=fields["ttft"], itl_ms=fields["itl"], quantile=quantile)


def load_trace(path: str | Path, rate: float | None = None) -> Workload:
    """A workload from a JSON-lines trace; the rate from its timestamps unless `rate` is given."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read trace {p}: {exc.strerror or exc}") from None
    prompts, outputs, stamps = [], [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(int(row["prompt_tokens"]))
            outputs.append(int(row["output_tokens"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ConfigError(f"{p}:{n}: each line needs prompt_tokens and output_tokens (integers)") from None
        if "timestamp" in row:
            stamps.append(float(row["timestamp"]))
    if not prompts or min(prompts) <= 0 or min(outputs) <= 0:
        raise ConfigError(f"trace {p} holds no requests with positive lengths")
    if rate is None:
        if len(stamps) != len(prompts) or len(stamps) < 2 or max(stamps) <= min(stamps):
            raise UsageError(f"trace {p} has no timestamps to take a rate from", hint="give --rate")
        rate = (len(stamps) - 1) / (max(stamps) - min(stamps))
    return Workload(rate=rate, prompt_tokens=prompts, output_tokens=outputs)


def make_workload(rate: float | None, prompt_tokens: str, output_tokens: str, trace: str | Path | None = None) -> Workload:
    """The workload from the CLI's words: a trace file, or a rate and two length distributions."""
    if rate is not None and not rate > 0:
        raise UsageError(f"--rate must be positive, got {rate}")
    if trace is not None:
        return load_trace(trace, rate)
    if rate is None:
        raise UsageError("no request rate given", hint="pass --rate REQ_PER_S, or --trace FILE with timestamps")
    return Workload(rate=rate, prompt_tokens=parse_lengths(prompt_tokens, "--prompt-tokens"),
                    output_tokens=parse_lengths(output_tokens, "--output-tokens"))  # fmt: skip

"""The profile file: what running engines measured, with the model and the hardware it was measured on.

One JSON document (msgspec), versioned by `version`. A reader refuses a
newer version than it knows rather than guessing at fields. Raw
measurements are kept beside the fitted curves, so a profile can be
refitted, or checked by eye, without the engines.

    {"version": 1, "created": "...", "model": {...}, "hardware": {...},
     "prefill": [{"prompt_tokens", "concurrency", "latencies_ms", "makespan_ms", "engine_ms", "engine_steps"}, ...],
     "decode": [{"batch", "context_tokens", "output_tokens", "itl_ms", "kv_usage", "running", "engine_itl_ms", "mean_batch"}, ...],
     "prefill_fit": {...}, "decode_fit": {...}, "handover_ms": 0.0}
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from pdkv.errors import ConfigError
from pdkv.planner.fit import DecodeFit, PrefillFit, fit_decode, fit_prefill

PROFILE_VERSION = 1


class ModelInfo(msgspec.Struct, frozen=True):
    """The served model as the engines report it."""

    name: str  # the id /v1/models gives
    max_model_len: int | None = None
    block_size: int | None = None  # vllm:cache_config_info
    kv_capacity_tokens: int | None = None  # D's KV blocks x block size: how many tokens a D can hold at once
    kv_bytes_per_token: int | None = None  # from the model's config (pdkv.geometry), when --model was given


class Hardware(msgspec.Struct, frozen=True):
    """Where the engines ran. `description` is the operator's words (e.g. "1 x H200, TP 1"), else what was detected here."""

    description: str
    host: str = ""
    cpus: int = 0
    platform: str = ""
    gpus: list[str] = []
    vllm_version: str | None = None


class PrefillBurst(msgspec.Struct, frozen=True):
    """`concurrency` distinct prompts of `prompt_tokens` sent at once to P, one output token each."""

    prompt_tokens: int
    concurrency: int
    latencies_ms: list[float]  # each request's, send to answer
    makespan_ms: float  # the last answer
    # P's own time for the burst's requests, summed: the growth of vllm:request_queue_time_seconds and
    # vllm:request_prefill_time_seconds (the engine core's stamps: queued, scheduled, first token); None: not read
    engine_ms: float | None = None
    # P's forwards that answered the burst: the growth of vllm:iteration_tokens_total's count; None: not read
    engine_steps: int | None = None


class DecodeRun(msgspec.Struct, frozen=True):
    """`batch` streams of `output_tokens` each, over prompts of `context_tokens`, running together on D."""

    batch: int
    context_tokens: int
    output_tokens: int
    itl_ms: list[float]  # each stream's mean gap between tokens after its first, as the client saw them arrive
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc, the highest seen during the run (0..1)
    running: int | None = None  # vllm:num_requests_running, the highest seen
    engine_itl_ms: float | None = None  # D's own vllm:inter_token_latency_seconds over the run (sum / count)
    mean_batch: float | None = None  # D's own: tokens generated over engine steps during the run

    @property
    def decode_ms(self) -> float | None:
        """The run's ITL: D's own figure where its /metrics gave one, else the median of the client's."""
        if self.engine_itl_ms is not None:
            return self.engine_itl_ms
        return median(self.itl_ms) if self.itl_ms else None

    @property
    def ran_batch(self) -> float:
        """The batch D ran at: its own mean where its /metrics gave one, else the batch asked for."""
        return self.mean_batch if self.mean_batch else self.batch

    @property
    def kv_tokens(self) -> float:
        """KV the batch holds halfway through its decode: the fit's T."""
        return self.ran_batch * (self.context_tokens + self.output_tokens / 2)


class Profile(msgspec.Struct, frozen=True):
    version: int
    created: str
    model: ModelInfo
    hardware: Hardware
    prefill_url: str
    decode_url: str
    prefill: list[PrefillBurst]
    decode: list[DecodeRun]
    prefill_fit: PrefillFit
    decode_fit: DecodeFit
    handover_ms: float = 0.0  # P's answer to D's first token beyond D's step (transfer, notification); 0 when not measured
    handover_source: str = "not measured"


def median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def outside_ms(prefill: list[PrefillBurst]) -> float:
    """A request's time outside P's engine: the median, over bursts of one request whose engine time was read, of its
    latency less that time (0 when none was read)."""
    gaps = [b.latencies_ms[0] - b.engine_ms for b in prefill if b.concurrency == 1 and b.engine_ms is not None and b.latencies_ms]
    return round(max(0.0, median(gaps)), 3) if gaps else 0.0


def fits_from(prefill: list[PrefillBurst], decode: list[DecodeRun]) -> tuple[PrefillFit, DecodeFit]:
    """The curves through the raw measurements (a decode run counts by its `decode_ms`; P's by its engine time, the
    time outside the engine apart)."""
    p = fit_prefill([(b.prompt_tokens, b.concurrency, b.makespan_ms, b.engine_steps or 1) for b in prefill], outside_ms(prefill))
    d = fit_decode([(r.ran_batch, r.kv_tokens, ms) for r in decode if (ms := r.decode_ms) is not None])
    return p, d


def unbatched_runs(decode: list[DecodeRun], share: float = 0.5) -> list[DecodeRun]:
    """Decode runs of 4 or more streams that D ran at under `share` of the batch asked for (by its own counters): the
    streams did not overlap, most often because the engine or its API server was short of CPU."""
    return [r for r in decode if r.batch >= 4 and r.mean_batch is not None and r.mean_batch < share * r.batch]


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n")


def load_profile(path: str | Path) -> Profile:
    """Read a profile file; ConfigError (exit 2) for a missing, malformed or newer one."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read profile {p}: {exc.strerror or exc}", hint="write one with `pdkv profile -o FILE`") from None
    try:
        head = msgspec.json.decode(raw, type=dict)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"profile {p} is not JSON: {exc}") from None
    version = head.get("version")
    if not isinstance(version, int) or version < 1:
        raise ConfigError(f"profile {p} has no valid version field", hint="is it a file `pdkv profile` wrote?")
    if version > PROFILE_VERSION:
        raise ConfigError(f"profile {p} is version {version}; this pdkv reads up to {PROFILE_VERSION}", hint="upgrade pdkv")
    try:
        profile = msgspec.json.decode(raw, type=Profile)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"profile {p}: {exc}") from None
    if not profile.prefill or not profile.decode:
        raise ConfigError(f"profile {p} holds no prefill or no decode measurements")
    return profile

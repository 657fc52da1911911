"""Profiles the planner's tests share: a Profile built from chosen curve coefficients, its raw points drawn from them."""

from __future__ import annotations

from pdkv.planner.fit import DecodeFit, PrefillFit
from pdkv.planner.profile import PROFILE_VERSION, DecodeRun, Hardware, ModelInfo, PrefillBurst, Profile


def make_profile(
    prefill: tuple[float, float, float, float] = (10.0, 0.0, 0.1, 0.0),
    decode: tuple[float, float, float] = (20.0, 0.5, 0.0),
    *,
    capacity: int | None = None,
    handover_ms: float = 0.0,
    outside_ms: float = 0.0,
) -> Profile:
    """A profile whose fits are exactly `prefill` (overhead, per request, per token, per token^2; `outside_ms` a
    request's time outside the engine) and `decode` (base, per sequence, per KV token), its raw points on those curves."""
    pf = PrefillFit(*prefill, outside_ms=outside_ms)
    df = DecodeFit(*decode)
    bursts = [PrefillBurst(n, c, [pf.step_ms(n * c, n * n * c, c) + outside_ms] * c, pf.step_ms(n * c, n * n * c, c) + outside_ms,
                           pf.step_ms(n * c, n * n * c, c) if c == 1 else None)
              for n in (128, 512, 1024) for c in (1, 4)]  # fmt: skip
    runs = [DecodeRun(b, ctx, 64, [df.itl_ms(b, b * (ctx + 32))] * b) for b in (1, 8) for ctx in (256, 1024)]
    return Profile(
        version=PROFILE_VERSION,
        created="2026-12-03T00:00:00+00:00",
        model=ModelInfo(name="test-model", kv_capacity_tokens=capacity),
        hardware=Hardware(description="made up for a test"),
        prefill_url="http://127.0.0.1:1",
        decode_url="http://127.0.0.1:1",
        prefill=bursts,
        decode=runs,
        prefill_fit=pf,
        decode_fit=df,
        handover_ms=handover_ms,
    )


def write_profile(path, prefill=(10.0, 0.0, 0.1, 0.0), decode=(20.0, 0.5, 0.0), **kw):
    """make_profile(...) saved at `path` (for the CLI's tests); returns the path."""
    from pdkv.planner.profile import save_profile

    save_profile(make_profile(prefill, decode, **kw), path)
    return path

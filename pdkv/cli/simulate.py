"""`pdkv simulate`: a day of load on a simulated fleet, the planner's signal against the best static xPyD."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from pdkv.cli.options import JsonOpt
from pdkv.cli.output import console, err_console, print_json

HELP = """Simulate a day of traffic on a P/D fleet timed by a profile (`pdkv profile`): the planner's
desired-count signal scaling P and D (engines start after --startup-s, drain before they stop) against the
cheapest static xPyD that does as well that day (or reaches --goal). Prints the SLO attainment (requests
meeting both targets), TTFT/ITL p90 and engine-hours of each. The day's shape is a share of --peak-rate per
hour (--levels), squeezed into --day-seconds. The model is in docs/planner.md.

Examples:

  pdkv simulate --profile h200.profile.json --slo ttft=500,itl=40 --peak-rate 400 --prompt-tokens 200-2000 --output-tokens 64-512

  pdkv simulate --profile tiny.profile.json --slo ttft=300,itl=20 --peak-rate 50 --day-seconds 1800 --startup-s 60 --json

  pdkv simulate --profile p.json --slo ttft=800,itl=50 --trace requests.jsonl --peak-rate 100 --goal 0.99
"""


def _policy_bounds(text: str, flag: str) -> tuple[int, int]:
    from pdkv.errors import UsageError

    lo, sep, hi = text.partition("..")
    try:
        bounds = (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise UsageError(f"{flag} takes MIN..MAX engines, got {text!r}") from None
    return bounds


def simulate(
    profile: Annotated[Path, typer.Option("--profile", help="Profile file from `pdkv profile`.")],
    slo: Annotated[str, typer.Option("--slo", help="Latency targets in ms, ttft=MS,itl=MS.")],
    peak_rate: Annotated[float, typer.Option("--peak-rate", help="Requests per second at the day's peak.")],
    prompt_tokens: Annotated[str, typer.Option("--prompt-tokens", help="Prompt lengths: N, A-B or A,B,C.")] = "1000",
    output_tokens: Annotated[str, typer.Option("--output-tokens", help="Output lengths: N, A-B or A,B,C.")] = "128",
    trace: Annotated[Path | None, typer.Option("--trace", help="Take the lengths from this JSON-lines trace.")] = None,
    day_seconds: Annotated[float, typer.Option("--day-seconds", help="Simulated seconds the day is squeezed into.")] = 3600.0,
    levels: Annotated[str | None, typer.Option("--levels", help="Shares of the peak rate through the day, comma-separated.")] = None,
    quantile: Annotated[float, typer.Option("--quantile", help="The quantile the targets hold at.")] = 0.9,
    startup_s: Annotated[float, typer.Option("--startup-s", help="Seconds from asking for an engine to its serving.")] = 60.0,
    interval_s: Annotated[float, typer.Option("--interval-s", help="The signal's period, seconds.")] = 10.0,
    window_s: Annotated[float, typer.Option("--window-s", help="What the signal looks back on, seconds.")] = 30.0,
    down_after_s: Annotated[float, typer.Option("--down-after-s", help="Quiet before an engine is let go, seconds.")] = 60.0,
    down_margin: Annotated[float, typer.Option("--down-margin", help="Fewer engines only if latencies stay under this share.")] = 0.8,
    prefill_range: Annotated[str, typer.Option("--prefill-range", help="MIN..MAX prefill engines.")] = "1..256",
    decode_range: Annotated[str, typer.Option("--decode-range", help="MIN..MAX decode engines.")] = "1..256",
    max_batch_tokens: Annotated[int, typer.Option("--max-batch-tokens", help="P's tokens per forward.")] = 8192,
    goal: Annotated[float | None, typer.Option("--goal", help="Attainment the static fleet must reach (default: the planner's).")] = None,
    max_requests: Annotated[int, typer.Option("--max-requests", help="Refuse a day expected to hold more requests.")] = 2_000_000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of arrivals and lengths.")] = 0,
    json_out: JsonOpt = False,
) -> None:
    from pdkv.errors import UsageError
    from pdkv.planner import DAY_LEVELS, DayLoad, ScalePolicy, SimConfig, compare_day, load_profile, make_workload, parse_slo

    targets = parse_slo(slo, quantile)
    prof = load_profile(profile)
    workload = make_workload(peak_rate, prompt_tokens, output_tokens, trace)
    try:
        shape = tuple(float(v) for v in levels.split(",")) if levels else DAY_LEVELS
    except ValueError:
        raise UsageError(f"--levels takes comma-separated shares of the peak, got {levels!r}") from None
    load = DayLoad(peak_rate=peak_rate, duration_s=day_seconds, levels=shape)
    load.check()
    if load.expected_requests() > max_requests:
        raise UsageError(f"the day holds about {load.expected_requests():,.0f} requests, over --max-requests {max_requests:,}",
                         hint="shorten --day-seconds (the shape is kept) or raise --max-requests")  # fmt: skip
    pmin, pmax = _policy_bounds(prefill_range, "--prefill-range")
    dmin, dmax = _policy_bounds(decode_range, "--decode-range")
    policy = ScalePolicy(min_prefill=pmin, max_prefill=pmax, min_decode=dmin, max_decode=dmax, down_margin=down_margin,
                         down_after_s=down_after_s)  # fmt: skip
    policy.check()
    config = SimConfig(duration_s=day_seconds, startup_s=startup_s, interval_s=interval_s, window_s=window_s,
                       max_batch_tokens=max_batch_tokens, seed=seed)  # fmt: skip
    with err_console.status("simulating the day"):
        result = compare_day(prof, workload, targets, load, config, policy, goal)
    if json_out:
        print_json(result)
        return
    render_comparison(result, prof)


def render_comparison(c, prof) -> None:
    q = f"p{c.slo.quantile * 100:g}"
    console.print(f"[bold]pdkv simulate[/]: {c.planner.requests:,} requests over {c.load.duration_s:g} s, peak {c.load.peak_rate:g} req/s; "
                  f"targets TTFT {q} {c.slo.ttft_ms:g} ms, ITL {q} {c.slo.itl_ms:g} ms; profile of {prof.model.name} on "
                  f"{prof.hardware.description}")  # fmt: skip
    table = Table(title="The day, planner against static", title_justify="left")
    for col in ("fleet", "engines", "attainment", "TTFT p90", "ITL p90", "engine-hours"):
        table.add_column(col, justify="left" if col == "fleet" else "right")
    p, s = c.planner, c.static
    table.add_row("planner", f"up to {p.peak_prefill}P{p.peak_decode}D", f"{p.attainment:.2%}", f"{p.ttft_p90_ms:,.1f} ms",
                  f"{p.itl_p90_ms:,.1f} ms", f"{p.engine_hours:,.2f}")  # fmt: skip
    table.add_row("best static", f"{c.static_prefill}P{c.static_decode}D", f"{s.attainment:.2%}", f"{s.ttft_p90_ms:,.1f} ms",
                  f"{s.itl_p90_ms:,.1f} ms", f"{s.engine_hours:,.2f}")  # fmt: skip
    console.print(table)
    share = p.engine_hours / s.engine_hours if s.engine_hours else 0.0
    met = "" if c.static_meets_goal else f" (no static fleet tried reached {c.goal:.2%})"
    console.print(f"goal {c.goal:.2%}{met}; the planner's engine-hours are {share:.1%} of the best static fleet's "
                  f"({len(c.tried)} static fleets simulated)")  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("simulate", help=HELP)(simulate)

"""`pdkv trace`: one request through a live deployment, its timeline in the steps of docs/timeline.md and its TTFT split."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from pdkv.cli.options import AdminKeyOpt, JsonOpt, LinkGbpsOpt
from pdkv.cli.output import console, err_console, print_json

HELP = """Trace one request through a running P/D deployment: where its time to first token went.

Sends a streamed completion through pdkv's proxy with its own X-Request-Id,
then gathers the proxy's record of it and, from P's side channel (found
through the bootstrap server), what pdkv's connector recorded on P and D.
Prints every event in the step numbers of docs/timeline.md and the TTFT decomposition:
proxy forward + P queue and prefill + P's next step (left out when P wrote
the KV right after its forward) + wait for D's pull + transfer + D notified +
D's one-token forward, each in ms and as a share,
with the link floor beside the measured KV write. With vLLM's
MooncakeConnector only the proxy's part is visible.

Examples:

  pdkv trace --proxy http://127.0.0.1:8000

  pdkv trace --proxy http://10.0.0.5:8000 --prompt-tokens 4000 --max-tokens 16 --link-gbps 200

  pdkv trace --repeat 20 --html trace.html

  pdkv trace --prompt "The river runs north to the city" --json
"""

LANE_STYLE = {"client": "white", "proxy": "yellow", "P": "cyan", "D": "green"}
PHASE_COLORS = ("bright_black", "blue", "magenta", "yellow", "red", "green", "dark_orange", "grey50", "orchid")


def _ms(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def render_trace(trace, out: Console | None = None) -> None:
    """Print one Trace as rich tables: events, decomposition, transfer, notes (used by `pdkv up` too)."""
    out = out or console
    prompt = "?" if trace.prompt_tokens is None else f"{trace.prompt_tokens:,}"
    asked = "" if trace.requested_prompt_tokens is None else f" (asked for {trace.requested_prompt_tokens:,})"
    out.print(f"[bold]pdkv trace[/] {trace.request_id}  model {trace.model}  prompt {prompt} tokens{asked}  "
              f"output {trace.completion_tokens if trace.completion_tokens is not None else '?'} tokens")
    events = Table(title="Timeline (ms since the proxy received the request)", title_justify="left")
    for col, just in (("step", "right"), ("where", "left"), ("event", "left"), ("ms", "right"), ("what happens", "left")):
        events.add_column(col, justify=just)  # type: ignore[arg-type]
    for e in trace.events:
        events.add_row(e.step, Text(e.lane, style=LANE_STYLE.get(e.lane, "")), e.name, f"{e.t_ms:,.3f}", e.what)
    out.print(events)
    split = Table(title="TTFT decomposition", title_justify="left")
    for col, just in (("phase", "left"), ("steps", "left"), ("ms", "right"), ("share", "right"), ("", "left"), ("clock", "left")):
        split.add_column(col, justify=just)  # type: ignore[arg-type]
    for i, p in enumerate(trace.phases):
        color = PHASE_COLORS[i % len(PHASE_COLORS)]
        clock = Text(" -> ".join(p.clocks) + " (crosses clocks)", style="dark_orange") if p.crosses_clocks else Text(p.clocks[0])
        split.add_row(Text(p.name, style=color), p.steps, f"{p.ms:,.2f}", f"{p.share:.1%}",
                      Text("█" * max(1, round(p.share * 30)), style=color), clock)
    split.add_row(Text("sum", style="bold"), "", f"{trace.phases_ms:,.2f}", "100%", "",
                  f"TTFT: proxy {_ms(trace.proxy_ttft_ms)} ms, client {_ms(trace.client_ttft_ms)} ms")
    out.print(split)
    t = trace.transfer
    if t is not None:
        rate = "" if t.achieved_gbps is None else f" = {t.achieved_gbps:.2f} Gb/s"
        out.print(f"KV transfer: {t.bytes:,} B ({t.bytes / 2**20:,.2f} MiB) in {t.descriptors} descriptors from {t.workers} "
                  f"P worker(s); write {_ms(t.write_ms, 3)} ms{rate}; floor at {t.link_gbps:g} Gb/s {t.floor_ms:.3f} ms")
    for note in trace.notes:
        out.print(f"[dark_orange]note:[/] {note}")


def render_summary(summary, out: Console | None = None) -> None:
    out = out or console
    table = Table(title=f"Over {summary.runs} requests (ms)", title_justify="left")
    for col in ("phase", "steps", "p50", "p90", "min", "max"):
        table.add_column(col, justify="left" if col in ("phase", "steps") else "right")
    rows = [*summary.phases, *(s for s in (summary.proxy_ttft, summary.client_ttft, summary.transfer_write) if s is not None)]
    for s in rows:
        table.add_row(s.name, s.steps, f"{s.p50_ms:,.2f}", f"{s.p90_ms:,.2f}", f"{s.min_ms:,.2f}", f"{s.max_ms:,.2f}")
    out.print(table)


def trace(
    proxy: Annotated[str, typer.Option("--proxy", help="URL of pdkv's proxy.")] = "http://127.0.0.1:8000",
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Build a prompt of about this many tokens.")] = 1000,
    prompt: Annotated[str | None, typer.Option("--prompt", help="Send this text instead of a built prompt.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens D generates.")] = 128,
    repeat: Annotated[int, typer.Option("--repeat", "-n", help="Send this many requests, one after another; prints p50/p90.")] = 1,
    html: Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML timeline chart here.")] = None,
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", help="Bootstrap URL, when the proxy's is not reachable from here.")
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds one request may take.")] = 300.0,
    link_gbps: LinkGbpsOpt = 400.0,
    admin_key: AdminKeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    from pdkv.trace import render_html, run_traces

    with err_console.status("tracing") as status:
        result = run_traces(proxy, repeat=repeat, prompt_tokens=prompt_tokens, prompt=prompt, max_tokens=max_tokens,
                            link_gbps=link_gbps, bootstrap_url=bootstrap, timeout=timeout, admin_key=admin_key,
                            progress=lambda msg: status.update(f"tracing: {msg}"))
    if html is not None:
        html.write_text(render_html(result.traces, result.summary), encoding="utf-8")
    if json_out:
        print_json(result)
        return
    render_trace(result.traces[0])
    if result.summary is not None:
        render_summary(result.summary)
    if html is not None:
        console.print(f"chart written to {html}")


def register(app: typer.Typer) -> None:
    app.command("trace", help=HELP)(trace)

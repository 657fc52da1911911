"""The live view of a deployment in rich, as `pdkv top` and `pdkv up`'s console draw it (pdkv.top has the model)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Group
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from pdkv.top import TopView

STATE_STYLE = {"waiting": "dim", "starting": "yellow", "ready": "green", "restarting": "yellow", "failed": "red", "exited": "red",
               "stopped": "dim", "up": "green", "down": "red"}  # fmt: skip
ROLE_STYLE = {"bootstrap": "magenta", "prefill": "cyan", "decode": "green", "proxy": "yellow"}


def _num(v: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}{unit}"


def _bytes_per_s(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if v >= scale:
            return f"{v / scale:.1f} {unit}"
    return f"{v:.0f} B/s"


def engines_table(view: TopView) -> Table:
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1))
    for col in ("engine", "health", "running", "waiting", "KV usage", "waiting for KV", "url"):
        table.add_column(col, justify="right" if col in ("running", "waiting", "KV usage", "waiting for KV") else "left")
    for e in view.engines:
        health = Text("up", style="green") if e.up else Text(f"down: {e.reason}"[:32], style="red")
        table.add_row(Text(e.name, style=ROLE_STYLE.get(e.role, "")), health, str(e.running), str(e.waiting),
                      f"{e.kv_usage * 100:.1f}%", str(e.waiting_for_kv), e.url)  # fmt: skip
    return table


def figures(view: TopView) -> list[Text]:
    """The proxy's, the transfers' and the planner's lines."""
    s, t = view.serving, view.transfers
    errors = Text(f"errors {s.errors} ({_num(s.errors_per_s, '/s')})", style="red" if s.errors_per_s else "")
    lines = [
        Text.assemble(Text("requests ", style="bold"), f"{_num(s.requests_per_s, '/s')} (total {s.requests:,})   ",
                      f"TTFT p50 {_num(s.ttft_p50_ms, ' ms')} p90 {_num(s.ttft_p90_ms, ' ms')}   ",
                      f"ITL p50 {_num(s.itl_p50_ms, ' ms')} p90 {_num(s.itl_p90_ms, ' ms')}"),
        Text.assemble("         ", errors, f"   local fallbacks {s.local_fallbacks} ({_num(s.local_fallbacks_per_s, '/s')})"),
        Text.assemble(Text("transfers ", style="bold"), f"{_num(t.per_s, '/s')}  {_bytes_per_s(t.bytes_per_s)}   sent {t.sent:,}   ",
                      Text(f"failures {t.failures}", style="red" if t.failures else ""), "   ",
                      Text(f"recomputes {t.recomputes}", style="yellow" if t.recomputes else "")),
    ]
    if s.errors_by_cause:
        lines.append(Text("errors by cause: " + ", ".join(f"{c} {n}" for c, n in s.errors_by_cause.items()), style="red"))
    if view.planner is not None:
        p = view.planner
        lines.append(Text.assemble(Text("planner ", style="bold"),
                                   "desired " + "  ".join(f"{r} {n}" for r, n in p.desired.items()),
                                   "   serving " + "  ".join(f"{r} {n}" for r, n in p.current.items())))  # fmt: skip
    return lines


def header(view: TopView, title: str) -> Text:
    state = Text("up", style="green") if view.proxy_up else Text(f"down: {view.proxy_reason}", style="red")
    window = f"   over {view.window_s:.1f} s" if view.window_s else ""
    clock = time.strftime("%H:%M:%S", time.localtime(view.at))
    return Text.assemble(Text(title, style="bold"), f"   proxy {view.proxy_url} ", state, f"   {clock}{window}")


def render_view(view: TopView, title: str = "pdkv top", parts: Table | None = None, footer: Sequence[Text] = ()) -> Group:
    """The whole screen: header, the parts (`pdkv up`'s), the engines, the figures, then `footer`."""
    blocks: list = [header(view, title)]
    if parts is not None:
        blocks.append(parts)
    blocks.extend([engines_table(view), *figures(view), *footer])
    return Group(*blocks)

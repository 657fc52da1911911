"""A self-contained HTML page for traces: a sequence-diagram-like timeline in inline SVG, then tables.

Pure: Trace(s) in, one HTML string out, no external assets (no scripts,
fonts or images), so the file can be mailed or attached to an issue as is.
Lanes are the timeline's participants (client, proxy, P, D); time runs left to
right from the proxy receiving the request to the client's first token;
each phase of the TTFT decomposition is a band on the lane where it is
spent, and messages between participants are arrows.
"""

from __future__ import annotations

from html import escape

from pdkv.trace.model import LANES, Trace, TraceSummary

WIDTH = 1320
LEFT, RIGHT = 120, 40
LANE_H = 130
LABEL_ROWS = 8  # five above the lane line, three below its bands
PALETTE = ("#8e8e8e", "#3b78c2", "#7b5cc4", "#c9a227", "#d9534f", "#2f9e78", "#e07b24", "#5f7f8f", "#b85c9e")
LANE_NAMES = {"client": "Client", "proxy": "Proxy", "P": "Prefill (P)", "D": "Decode (D)"}
# Messages between participants: (from event, to event).
ARROWS = (
    ("client_sent", "received"),
    ("prefill_dispatched", "registered"),
    ("decode_dispatched", "pull_scheduled"),
    ("pull_sent", "pull_received"),
    ("p_computed", "prefill_responded"),
    ("reply_sent", "notified"),
    ("decode_first_byte", "client_first_token"),
)
PHASE_LANE = {"proxy forward": "proxy", "P queue": "P", "D notified": "D", "D one-token forward": "D", "transfer": "P",
              "P forward on the GPU": "P"}

CSS = """
body{font:14px/1.45 -apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#1d2430;margin:24px 32px;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:26px 0 8px}
.meta{color:#555;margin-bottom:12px}.meta b{color:#1d2430}
table{border-collapse:collapse;margin:4px 0 8px}th,td{padding:3px 10px;border-bottom:1px solid #e3e6ea;text-align:left}
th{background:#f4f6f8;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.bar{display:inline-block;height:10px;border-radius:2px;vertical-align:middle}
.cross{color:#b0562b;font-size:12px}.note{color:#6b4e16;background:#fff7e0;padding:6px 10px;border-radius:4px;margin:4px 0}
svg text{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif}
"""


def _ms(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


class _Scale:
    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.span = t0, max(t1 - t0, 1e-6)

    def x(self, t_ms: float) -> float:
        return LEFT + (t_ms - self.t0) / self.span * (WIDTH - LEFT - RIGHT)


def _lane_y(lane: str, top: float) -> float:
    return top + LANES.index(lane) * LANE_H + LANE_H / 2


def _colors(trace: Trace) -> dict[str, str]:
    return {p.name: PALETTE[i % len(PALETTE)] for i, p in enumerate(trace.phases)}


def _phase_lane(name: str, end_event_lane: str) -> str:
    return PHASE_LANE.get(name, end_event_lane)


def timeline_svg(trace: Trace) -> str:
    """The timeline picture of one trace as an <svg> element."""
    at = {e.name: e for e in trace.events}
    end_ms = max([e.t_ms for e in trace.events if e.name in ("client_first_token", "decode_first_byte")] or [1.0])
    start_ms = min([0.0] + [e.t_ms for e in trace.events if e.name == "client_sent"])
    pad = (end_ms - start_ms) * 0.03
    sc = _Scale(start_ms - pad, end_ms + pad)
    colors = _colors(trace)
    legend: list[str] = []
    lx, ly = LEFT, 70
    for p in trace.phases:
        label = f"{p.name} ({p.steps}) {p.ms:.2f} ms · {p.share:.0%}"
        w = 20 + len(label) * 6.2
        if lx + w > WIDTH - RIGHT:
            lx, ly = LEFT, ly + 20
        legend.append(f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{colors[p.name]}"/>'
                      f'<text x="{lx + 17}" y="{ly}" font-size="12">{escape(label)}</text>')
        lx += w + 16
    top = ly + 22
    height = top + len(LANES) * LANE_H + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img">',
           '<defs><marker id="arr" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
           '<path d="M0,0 L10,5 L0,10 z" fill="#444"/></marker></defs>']
    # The decomposition as one stacked bar on the same time axis, with a legend under it.
    out.append(f'<text x="{LEFT}" y="22" font-size="13" font-weight="600">TTFT {_ms(trace.proxy_ttft_ms)} ms at the proxy'
               f'{"" if trace.client_ttft_ms is None else f" ({_ms(trace.client_ttft_ms)} ms at the client)"}</text>')
    for p in trace.phases:
        x0, x1 = sc.x(p.start_ms), sc.x(p.end_ms)
        out.append(f'<rect x="{x0:.1f}" y="32" width="{max(x1 - x0, 1.5):.1f}" height="18" fill="{colors[p.name]}">'
                   f'<title>{escape(p.name)} ({p.steps}): {p.ms:.2f} ms</title></rect>')
    out += legend
    # Lanes.
    for i, lane in enumerate(LANES):
        y = top + i * LANE_H
        out.append(f'<rect x="0" y="{y}" width="{WIDTH}" height="{LANE_H}" fill="{"#f7f9fb" if i % 2 else "#ffffff"}"/>')
        out.append(f'<text x="12" y="{y + LANE_H / 2 + 5}" font-size="14" font-weight="600">{LANE_NAMES[lane]}</text>')
        mid = y + LANE_H / 2
        out.append(f'<line x1="{LEFT}" y1="{mid}" x2="{WIDTH - RIGHT}" y2="{mid}" stroke="#c5ccd3" stroke-dasharray="4 4"/>')
    # Phase bands on the lane where the time is spent.
    for p in trace.phases:
        e = at.get(p.end)
        lane = _phase_lane(p.name, e.lane if e is not None else "proxy")
        x0, x1 = sc.x(p.start_ms), sc.x(p.end_ms)
        y = _lane_y(lane, top)
        out.append(f'<rect x="{x0:.1f}" y="{y - 13}" width="{max(x1 - x0, 2):.1f}" height="26" rx="3" fill="{colors[p.name]}" '
                   f'fill-opacity="0.85"><title>{escape(p.name)}: {p.ms:.2f} ms</title></rect>')
        text = f"{p.name} {p.ms:.1f} ms"
        if x1 - x0 > len(text) * 6.4 + 8:
            out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y + 4}" font-size="11" fill="#fff" text-anchor="middle">{escape(text)}</text>')
    # The KV write itself, P to D.
    if "transfer_start" in at and "transfer_end" in at:
        xs, xe = sc.x(at["transfer_start"].t_ms), sc.x(at["transfer_end"].t_ms)
        yp, yd = _lane_y("P", top), _lane_y("D", top)
        out.append(f'<polygon points="{xs:.1f},{yp + 13} {xe:.1f},{yp + 13} {xe:.1f},{yd - 13} {xs:.1f},{yd - 13}" '
                   f'fill="#d9534f" fill-opacity="0.25" stroke="#d9534f"><title>KV write</title></polygon>')
    for a, b in ARROWS:
        if a in at and b in at:
            ea, eb = at[a], at[b]
            out.append(f'<line x1="{sc.x(ea.t_ms):.1f}" y1="{_lane_y(ea.lane, top)}" x2="{sc.x(eb.t_ms):.1f}" y2="{_lane_y(eb.lane, top)}" '
                       f'stroke="#444" stroke-width="1.3" marker-end="url(#arr)"/>')
    # Event dots with their step; labels go to the lowest free row above the lane line.
    rows: dict[str, list[list[tuple[float, float]]]] = {lane: [[] for _ in range(LABEL_ROWS)] for lane in LANES}
    for e in sorted(trace.events, key=lambda ev: ev.at):
        if e.t_ms > end_ms + pad:
            continue
        x, y = sc.x(e.t_ms), _lane_y(e.lane, top)
        label = f"{e.step} {e.name}"
        w = len(label) * 6.1 + 4
        x0 = x + 3 if x + 3 + w < WIDTH - 4 else x - 3 - w
        free = [r for r in range(LABEL_ROWS) if all(x0 + w < a or x0 > b for a, b in rows[e.lane][r])]
        row = free[0] if free else LABEL_ROWS - 1
        rows[e.lane][row].append((x0, x0 + w))
        ty = y - 20 - row * 14 if row < 5 else y + 28 + (row - 5) * 13
        out.append(f'<circle cx="{x:.1f}" cy="{y}" r="4" fill="#1d2430"><title>{escape(e.name)} (step {e.step}): '
                   f'{e.t_ms:.3f} ms</title></circle>')
        if row:
            y1, y2 = (y - 5, ty + 2) if row < 5 else (y + 5, ty - 10)
            out.append(f'<line x1="{x:.1f}" y1="{y1}" x2="{x:.1f}" y2="{y2}" stroke="#9aa3ad" stroke-width="0.8"/>')
        anchor = "start" if x0 > x else "end"
        tx = x + 3 if anchor == "start" else x - 3
        out.append(f'<text x="{tx:.1f}" y="{ty}" font-size="11" fill="#333" text-anchor="{anchor}">{escape(label)}</text>')
    # Time axis.
    ya = top + len(LANES) * LANE_H + 4
    out.append(f'<line x1="{LEFT}" y1="{ya}" x2="{WIDTH - RIGHT}" y2="{ya}" stroke="#888"/>')
    step = _tick(end_ms - start_ms)
    t = 0.0
    while t <= end_ms + pad:
        x = sc.x(t)
        out.append(f'<line x1="{x:.1f}" y1="{ya}" x2="{x:.1f}" y2="{ya + 5}" stroke="#888"/>'
                   f'<text x="{x:.1f}" y="{ya + 18}" font-size="11" text-anchor="middle" fill="#555">{t:g} ms</text>')
        t += step
    out.append("</svg>")
    return "\n".join(out)


def _tick(span: float) -> float:
    for s in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000):
        if span / s <= 12:
            return float(s)
    return 20000.0


def _phase_table(trace: Trace) -> str:
    colors = _colors(trace)
    rows = []
    for p in trace.phases:
        cross = f'<span class="cross">crosses clocks: {" → ".join(p.clocks)}</span>' if p.crosses_clocks else escape(p.clocks[0])
        rows.append(f'<tr><td><span class="bar" style="width:12px;background:{colors[p.name]}"></span> {escape(p.name)}</td>'
                    f'<td>{escape(p.steps)}</td><td class="n">{p.ms:.2f}</td><td class="n">{p.share:.1%}</td>'
                    f'<td><span class="bar" style="width:{max(p.share * 300, 1):.0f}px;background:{colors[p.name]}"></span></td>'
                    f'<td>{cross}{(" · " + escape(p.note)) if p.note else ""}</td></tr>')
    total = sum(p.ms for p in trace.phases)
    rows.append(f'<tr><th>sum</th><th></th><th class="n">{total:.2f}</th><th class="n">100%</th><th></th>'
                f'<th>TTFT at the proxy {_ms(trace.proxy_ttft_ms)} ms; at the client {_ms(trace.client_ttft_ms)} ms</th></tr>')
    return ("<table><tr><th>phase</th><th>steps</th><th>ms</th><th>share</th><th></th><th>clock</th></tr>"
            + "".join(rows) + "</table>")


def _transfer_table(trace: Trace) -> str:
    t = trace.transfer
    if t is None:
        return "<p>No KV transfer was recorded for this request.</p>"
    rows = [("bytes moved", f"{t.bytes:,} ({t.bytes / 2**20:,.2f} MiB)"), ("write descriptors", f"{t.descriptors}"),
            ("P workers", f"{t.workers}"), ("KV write, measured (P's clock)", f"{_ms(t.write_ms, 3)} ms"),
            (f"link floor at {t.link_gbps:g} Gb/s", f"{t.floor_ms:.3f} ms"),
            ("achieved rate", "—" if t.achieved_gbps is None else f"{t.achieved_gbps:.2f} Gb/s"),
            ("outcome", escape(t.status + (f": {t.error}" if t.error else "")))]
    return "<table>" + "".join(f"<tr><th>{k}</th><td class='n'>{v}</td></tr>" for k, v in rows) + "</table>"


def _events_table(trace: Trace) -> str:
    rows = "".join(f"<tr><td>{escape(e.step)}</td><td>{escape(LANE_NAMES[e.lane])}</td><td>{escape(e.name)}</td>"
                   f"<td>{escape(e.what)}</td><td class='n'>{e.t_ms:,.3f}</td></tr>" for e in trace.events)
    return ("<table><tr><th>step</th><th>where</th><th>event</th><th>what happens</th><th>ms since the proxy received it</th></tr>"
            + rows + "</table>")


def _summary_table(summary: TraceSummary) -> str:
    rows = [*summary.phases, *(s for s in (summary.proxy_ttft, summary.client_ttft, summary.transfer_write) if s is not None)]
    body = "".join(f"<tr><td>{escape(s.name)}</td><td>{escape(s.steps)}</td><td class='n'>{s.p50_ms:.2f}</td>"
                   f"<td class='n'>{s.p90_ms:.2f}</td><td class='n'>{s.min_ms:.2f}</td><td class='n'>{s.max_ms:.2f}</td>"
                   f"<td class='n'>{s.n}</td></tr>" for s in rows)
    return (f"<h2>Over {summary.runs} requests</h2><table><tr><th>phase</th><th>steps</th><th>p50 ms</th><th>p90 ms</th>"
            f"<th>min</th><th>max</th><th>n</th></tr>{body}</table>")


def render_html(traces: list[Trace], summary: TraceSummary | None = None) -> str:
    """The whole page: the first trace's timeline and tables, then the summary of all when given."""
    if not traces:
        raise ValueError("render_html needs at least one trace")
    t = traces[0]
    prompt = "—" if t.prompt_tokens is None else f"{t.prompt_tokens:,}"
    meta = (f"request <b>{escape(t.request_id)}</b> · model <b>{escape(t.model)}</b> · prompt <b>{prompt}</b> tokens · "
            f"output <b>{t.completion_tokens if t.completion_tokens is not None else '—'}</b> tokens · "
            f"whole answer {_ms(t.total_ms, 1)} ms at the client · "
            f"{'one host, one clock' if t.one_host else 'several hosts: phases marked as crossing clocks depend on them agreeing'}")
    notes = "".join(f'<div class="note">{escape(n)}</div>' for n in t.notes)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>pdkv trace {escape(t.request_id)}</title><style>{CSS}</style></head><body>",
        "<h1>pdkv trace: where this request's time to first token went</h1>",
        f'<div class="meta">{meta}</div>', notes, timeline_svg(t),
        "<h2>TTFT decomposition</h2>", _phase_table(t),
        "<h2>KV transfer (steps 28-31)</h2>", _transfer_table(t),
        "<h2>Events, in order</h2>", _events_table(t),
    ]
    if summary is not None:
        parts.append(_summary_table(summary))
    parts.append("</body></html>")
    return "\n".join(parts)

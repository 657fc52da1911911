"""`pdkv trace`: one request's timeline on a live deployment, in the steps of docs/timeline.md, and its TTFT split.

    model.py     the typed results (Trace, Phase, TraceEvent, TransferFacts, TraceSummary)
    assemble.py  records -> Trace, and p50/p90 over several (pure)
    collect.py   sending the request and gathering the proxy's, P's and D's records (I/O)
    html.py      a self-contained HTML timeline chart (pure)
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trace", "TraceResult", "assemble", "render_html", "run_trace", "run_traces", "summarize"]


def __getattr__(name: str) -> Any:
    if name in ("run_trace", "run_traces", "TraceSession"):
        from pdkv.trace import collect

        return getattr(collect, name)
    if name in ("assemble", "summarize"):
        from pdkv.trace import assemble

        return getattr(assemble, name)
    if name == "render_html":
        from pdkv.trace.html import render_html

        return render_html
    if name in ("Trace", "TraceResult"):
        from pdkv.trace import model

        return getattr(model, name)
    raise AttributeError(f"module 'pdkv.trace' has no attribute {name!r}")

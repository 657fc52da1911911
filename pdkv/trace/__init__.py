"""`pdkv trace`: one request's timeline on a live deployment, in the steps of docs/timeline.md, and its TTFT split.

    model.py     the typed results (Trace, Phase, TraceEvent, TransferFacts, TraceSummary)
    assemble.py  records -> Trace, and p50/p90 over several (pure)
    collect.py   sending the request and gathering the proxy's, P's and D's records (I/O)
    html.py      a self-contained HTML timeline chart (pure)
"""

from pdkv.trace.assemble import assemble, summarize
from pdkv.trace.collect import TraceSession, run_trace, run_traces
from pdkv.trace.html import render_html
from pdkv.trace.model import Trace, TraceResult

__all__ = ["Trace", "TraceResult", "TraceSession", "assemble", "render_html", "run_trace", "run_traces", "summarize"]

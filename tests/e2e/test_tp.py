"""P and D of different TP sizes, started by `pdkv up -f` on a CPU host (tiny model, 2 KV heads, pdkv's connector).

For P TP 1 with D TP 2 and P TP 2 with D TP 1, over cma and over Mooncake tcp: the deployment comes up
(each TP rank on a core of its own where the host has the cores; on two cores P's and D's ranks share
them: P TP 2 beside D TP 1 then relies on the connector's hold_wait_ms, docs/connector.md); greedy answers
through the proxy equal P alone's for prompts of 1, 17 and about 1,000 tokens and for 8 requests in flight
(first-token logprobs within loadclient's tolerance; tokens equal up to where P alone's top two nearly tie,
CROSS_TP_TIE); both engines' KV cache usage is back to 0 afterwards; and the trace of one request shows the
bytes each rank moved, equal to `pdkv plan --tp P:D`'s per rank and adding up to the prompt's KV.
vLLM's own MooncakeConnector (behind the test-only CPU shim) with P TP 1 and D TP 2 over Mooncake tcp gives
the same answers through pdkv up and pdkv's proxy, where the host has a core for each rank (VLLM_STARVED).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from support.loadclient import WORDS, Answer, Case, kv_usage, one, prompts, run_load, same_greedy_answer
from support.ports import free_port
from support.waiting import wait_for

from pdkv.tinymodel import TINY_KV_CACHE_BYTES

pytestmark = pytest.mark.e2e

READY_TIMEOUT_S = float(os.environ.get("PDKV_E2E_UP_TIMEOUT", "600"))
# A TP 1 and a TP 2 engine sum a layer's partial results in other orders: their bf16 logprobs differ in the last
# bits, so P alone's top two tokens may swap where they are this close. KV in the wrong blocks (or heads) moves the
# first token's logprob far more (loadclient.FIRST_LOGPROB_TOL, checked on every answer).
CROSS_TP_TIE = 2e-2
BLOCK = 32
# name -> (P's TP, D's TP, transport, connector); vLLM's own connector runs on CPU behind the test-only shim.
CASES = {"p1-d2-cma": (1, 2, "cma", "pdkv"), "p2-d1-cma": (2, 1, "cma", "pdkv"), "p1-d2-tcp": (1, 2, "tcp", "pdkv"),
         "p2-d1-tcp": (2, 1, "tcp", "pdkv"), "p1-d2-mooncake": (1, 2, "tcp", "mooncake")}
SHIM = Path(__file__).resolve().parents[1] / "shims" / "cpu_accelerator"
# Seen twice on the 2-core machine with vLLM's connector, P TP 1 on core 0 and D TP 2 on cores 0-1: within 20 s of
# the proxy starting, P's /health stopped answering in 2 s and pdkv up's warm-up through the proxy failed (once "had
# no answer within 120 s", D's log silent past its start; once D "answered 500" after about a minute). The likely
# cause, not measured: vLLM's connector runs P's worker in a process of its own, and while P holds blocks for D
# vLLM steps P without pause, its engine core and worker each busy on core 0, where D's rank 0 runs too; pdkv's
# hold_wait_ms is pdkv's connector's and cannot help there.
VLLM_STARVED = ("vLLM's MooncakeConnector with P TP {p_tp} beside D TP {d_tp} needs {n} cores, this host has {cores}: "
                "P stopped answering and the warm-up failed on two cores (see VLLM_STARVED's comment)")


def cores(p_tp: int, d_tp: int) -> tuple[str, str]:
    """omp_bind of P and D: distinct cores for every rank where the host has them, else P's first and D's last."""
    n = os.cpu_count() or 2
    if n >= p_tp + d_tp:
        return f"0-{p_tp - 1}", f"{p_tp}-{p_tp + d_tp - 1}"
    return f"0-{p_tp - 1}", f"{n - d_tp}-{n - 1}"


def fleet_file(path: Path, model: Path, p_tp: int, d_tp: int, transport: str, connector: str) -> dict[str, int]:
    ports = {"bootstrap": free_port(), "prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    p_cores, d_cores = cores(p_tp, d_tp)
    path.write_text(f"""
model = "{model}"
served_model_name = "tiny"
connector = "{connector}"
transport = "{transport}"
platform = "cpu"
host = "127.0.0.1"
host_ip = "127.0.0.1"
block_size = {BLOCK}
max_model_len = 2048
cpu_kv_cache_bytes = {TINY_KV_CACHE_BYTES}
restart = "no"

[bootstrap]
mode = "standalone"
port = {ports["bootstrap"]}

[[prefill]]
port = {ports["prefill"]}
tp = {p_tp}
omp_bind = "{p_cores}"

[[decode]]
port = {ports["decode"]}
tp = {d_tp}
omp_bind = "{d_cores}"

[proxy]
port = {ports["proxy"]}
""")
    return ports


@dataclass
class Deployment:
    name: str
    p_tp: int
    d_tp: int
    model: Path
    proxy: str
    prefill: str
    decode: str
    logs: Path
    connector: str = "pdkv"

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
                         for p in sorted(self.logs.glob("*.log")))


def _wait_ready(proc: subprocess.Popen[str], deadline: float) -> dict:
    assert proc.stdout is not None
    for line in proc.stdout:
        with contextlib.suppress(json.JSONDecodeError):
            event = json.loads(line)
            if event.get("event") == "ready":
                return event
        if time.monotonic() > deadline:
            break
    raise AssertionError("pdkv up ended or timed out before it was ready")


# The extended tier (README, "Tests"): pdkv's TP head split over Mooncake tcp, the cma cases' split on another
# transport; and D with more ranks than P over cma, whose head split tests/integration/test_connector_tp.py drives over
# real transports (p1-d2, p1-d4), while P with more ranks than D stays here.
EXTENDED = {"p1-d2-tcp", "p2-d1-tcp", "p1-d2-cma"}


@pytest.fixture(scope="module", params=[pytest.param(c, marks=pytest.mark.extended) if c in EXTENDED else c for c in CASES],
                ids=list(CASES))
def deployment(request, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    p_tp, d_tp, transport, connector = CASES[request.param]
    if connector == "mooncake" and (os.cpu_count() or 2) < p_tp + d_tp:
        pytest.skip(VLLM_STARVED.format(p_tp=p_tp, d_tp=d_tp, n=p_tp + d_tp, cores=os.cpu_count()))
    tmp = tmp_path_factory.mktemp(request.param)
    ports = fleet_file(tmp / "fleet.toml", tiny_model, p_tp, d_tp, transport, connector)
    logs = tmp / "logs"
    env = dict(os.environ)
    if connector == "mooncake":  # pdkv up's pre-flight lets vLLM's connector start on CPU only with the shim in sight
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM), env.get("PYTHONPATH", "")) if p)
    with (tmp / "up.stderr").open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "pdkv", "up", "-f", str(tmp / "fleet.toml"), "--json", "--log-dir", str(logs)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True, env=env)
    url = lambda port: f"http://127.0.0.1:{port}"
    dep = Deployment(request.param, p_tp, d_tp, tiny_model, url(ports["proxy"]), url(ports["prefill"]), url(ports["decode"]), logs,
                     connector)
    seen: set[int] = set()
    try:
        t0 = time.monotonic()
        try:
            _wait_ready(proc, t0 + READY_TIMEOUT_S)
        except AssertionError:
            raise AssertionError(f"{request.param}: {(tmp / 'up.stderr').read_text()[-3000:]}\n{dep.tails()}") from None
        print(f"\n{request.param}: pdkv up -f ready after {time.monotonic() - t0:.0f} s")
        with contextlib.suppress(psutil.NoSuchProcess):
            seen = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        yield dep
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        for pid in seen:  # nothing of this deployment may stay on the shared cores
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def _tokens(url: str, text: str) -> int:
    r = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": text}, timeout=30, trust_env=False)
    r.raise_for_status()
    return int(r.json()["count"])


def prompt_of(url: str, n: int) -> str:
    """A prompt of `n` tokens by P's own tokenizer, from the load suite's words: exactly `n` up to 100 tokens (a
    word is appended when it does not overshoot), the fewest words reaching `n` beyond."""
    words = WORDS * (n // 4 + 2)
    if n > 100:
        lo, hi = 1, len(words)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if _tokens(url, " ".join(words[:mid])) >= n else (mid + 1, hi)
        return " ".join(words[:lo])
    text, count = "", 0
    for w in words:
        trial = f"{text} {w}".strip()
        if count < n and (c := _tokens(url, trial)) <= n:
            text, count = trial, c
    assert count == n, (n, count)
    return text


def answers(base: str, cases: list[Case], concurrency: int) -> list[Answer]:
    return asyncio.run(run_load(base, cases, "tiny", concurrency))


def alone(dep: Deployment, cases: list[Case]) -> list[Answer]:
    async def each() -> list[Answer]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), trust_env=False) as client:
            return [await one(client, dep.prefill, c, "tiny", top=2) for c in cases]  # top two: where ties are

    return asyncio.run(each())


def assert_same(dep: Deployment, cases: list[Case], got: list[Answer], want: list[Answer]) -> None:
    for case, g, w in zip(cases, got, want, strict=True):
        assert w.status == 200, f"P alone: {w.error}"
        assert g.status == 200 and not g.error, f"{dep.name}: {g.error}\n{dep.tails()}"
        why = same_greedy_answer(g, w)
        if why is not None and why.startswith("token "):  # greedy answers may part where P alone's top two nearly tie
            i = int(why.split(":")[0].split()[1])
            why = None if w.top2_gap[i] < CROSS_TP_TIE else why
        assert why is None, f"{dep.name}, prompt of {len(case.prompt.split())} words: {why}"


def assert_no_blocks_held(dep: Deployment, within_s: float = 10.0) -> None:
    end = time.monotonic() + within_s
    usage = {}
    while time.monotonic() < end:
        usage = {"prefill": kv_usage(dep.prefill), "decode": kv_usage(dep.decode)}
        if not any(usage.values()):
            return
        time.sleep(0.25)
    raise AssertionError(f"{dep.name}: KV cache still in use {within_s:g} s after the requests: {usage}")


def test_greedy_answers_equal_p_alones_for_1_17_and_1000_tokens(deployment: Deployment) -> None:
    cases = [Case("/v1/completions", prompt_of(deployment.prefill, n), stream=False) for n in (1, 17, 1000)]
    want = alone(deployment, cases)
    got = answers(deployment.proxy, cases, concurrency=1)
    assert_same(deployment, cases, got, want)
    assert_no_blocks_held(deployment)


def test_eight_requests_in_flight_equal_p_alones_and_free_every_block(deployment: Deployment) -> None:
    texts = prompts(11, [3, 9, 17, 40, 80, 150, 220, 270])
    cases = [Case("/v1/completions" if i % 2 else "/v1/chat/completions", t, stream=bool(i % 3)) for i, t in enumerate(texts)]
    want = alone(deployment, cases)
    got = answers(deployment.proxy, cases, concurrency=8)
    assert_same(deployment, cases, got, want)
    assert_no_blocks_held(deployment)


# Seen once in a whole-suite run on 2 cores (P and D rank 0 on one core): D rank 1's side channel to P reported
# its connection lost at every pull, so those pulls were recomputed (the answers above still matched) and the
# traced transfer failed. Not reproduced since: this module alone passed, and so did its p1-d2-tcp cases with a
# busy loop pinned to each core (no loss logged). The one way found for a live P to lose a connection is D's ZMQ
# heartbeat going unanswered (tests/integration/test_side_channel_stall.py stops P with SIGSTOP); its bound was
# 3 s, and under the busy loops P once answered nothing at all for over 10 s in the warm-up. The bound is now the
# receiver's liveness_s (10 s). Each loss logs how long the connection had lived, P's silence and the bound; each
# reconnection logs "made again"; a pull refused while lost says how long ago. Next time: losses with no "made
# again" between them mean D's reconnections never complete; repeated losses a few seconds old, a P that stalls.
# Seen again after that change, in a run of this module alone: the trace test failed once more (xfail), and in the
# same deployment D rank 1's pull of one request failed "prefill side silent for 10 s" while D rank 0's pull of
# the same transfer succeeded, no connection loss logged, nothing in P's log, and the standalone bootstrap did not
# answer the proxy's GET /pdkv/members within its timeout: the whole host stalled, not one socket. Still open:
# whether P sent D rank 1 nothing for 10 s or D rank 1's receiver loop did not run to read it.
# STARVED: what those stalls were, found later with p1-d2-cma (its trace failed twice in whole-suite runs the same
# way: D rank 1's pull "prefill side silent for 10 s", nothing in P's log), reproduced with a busy loop on each core:
# P's side-channel loop slept in a select of 0.02-0.2 s that returned after 10.1-10.2 s with no event, while P's
# whole worker process used 0.00 s of CPU and the loop thread's schedstat counted 10.4 s runnable but not run. P's
# worker and D rank 0's are both pinned to core 0 here, and vLLM's workers spin on sched_yield for a second after
# each read of their step queue (shm_broadcast's SpinCondition); on this kernel (6.18) P was left no CPU for ~10 s
# at a time, and D rank 1's pull (the rank that had heard nothing yet) hit its 10-s liveness bound. Not pdkv's
# writes (each took under 2 ms once P ran). A host with a core for each engine's worker does not share one this way.
# p2-d1-tcp, the same stalls seen from the other side (a run of this module alone): D shares core 0 with P rank 0's
# worker, and P's Mooncake tcp writes to D got no answer within 30 s in each of the three traced requests.
FLAKY_TRACE = {
    "p1-d2-tcp": "intermittent on 2 cores: D rank 1's pulls from P lost or silent while the host stalls (see the comment)",
    "p2-d1-tcp": "intermittent on 2 cores: an engine sharing core 0 left without CPU for seconds (STARVED above)",
}


def _proxy_ready(proxy: str) -> bool:
    try:
        return httpx.get(f"{proxy}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_trace_shows_each_ranks_bytes_equal_to_plans(deployment: Deployment, request: pytest.FixtureRequest) -> None:
    from pdkv.trace.collect import TraceSession

    if deployment.connector != "pdkv":
        pytest.skip("vLLM's MooncakeConnector keeps no per-rank transfer records for pdkv trace to read")
    if deployment.name in FLAKY_TRACE:
        request.applymarker(pytest.mark.xfail(reason=FLAKY_TRACE[deployment.name], strict=False))

    # Seen once (p1-d2-cma, whole suite): right after the tests above, P's /health missed the proxy's 2-s probe and
    # the trace refused a deployment not ready. The trace needs a ready one: wait for it, bounded.
    wait_for(lambda: _proxy_ready(deployment.proxy), 60, f"{deployment.name}'s proxy to report every backend ready", interval=1.0)
    # Up to three traced requests: on 2 cores P's worker shares core 0 with D rank 0's, and P was seen to get no CPU
    # at all for 10 s (see STARVED), so that one D rank's pull of a request timed out and D recomputed it. A request
    # whose pulls all landed must then show every rank's bytes; a wrong count fails all three. One session: each
    # request a new prompt (the same one again would find its blocks in P's and D's prefix caches and move fewer).
    with TraceSession(deployment.proxy, prompt_tokens=500, max_tokens=4, link_gbps=400) as session:
        for attempt in range(3):
            trace = session.once()
            assert trace.connector_visible, trace.notes
            moved: dict[tuple[int, int], int] = {}
            for r in trace.connector:
                if r.d_rank_bytes:
                    moved |= {(r.p_rank, int(d)): n for d, n in r.d_rank_bytes.items()}
                else:
                    moved[(r.p_rank, r.p_rank * deployment.d_tp // deployment.p_tp)] = r.bytes
            plan = json.loads(subprocess.run(
                [sys.executable, "-m", "pdkv", "plan", "--model", str(deployment.model), "--tp", f"{deployment.p_tp}:{deployment.d_tp}",
                 "--prompt-tokens", str(trace.prompt_tokens), "--block-size", str(BLOCK), "--json"],
                capture_output=True, text=True, check=True,
            ).stdout)
            print(f"\n{deployment.name} (trace {attempt + 1}): bytes by rank {moved}; plan "
                  f"{[(r['p_rank'], r['d_rank'], r['bytes']) for r in plan['ranks']]}")
            if moved == {(r["p_rank"], r["d_rank"]): r["bytes"] for r in plan["ranks"]}:
                break
    assert moved == {(r["p_rank"], r["d_rank"]): r["bytes"] for r in plan["ranks"]}
    assert trace.transfer is not None and trace.transfer.bytes == sum(moved.values()) == plan["transfer_bytes"]
    assert any(n.startswith("bytes by TP rank:") for n in trace.notes), trace.notes
    assert_no_blocks_held(deployment)

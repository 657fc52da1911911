"""kv-aware routing through pdkv's proxy at a real 1P1D pair (tiny model, CPU, pdkv's connector over cma),
both engines publishing KV events: greedy answers equal P alone's, on the P/D path and on D alone.

A chat of several turns under a shared system prompt: the first turn goes
P/D (D holds nothing); every later one finds D holding the history and is
served by D alone (kv_local), no P, no transfer. A second chat sharing the
system prompt goes P/D with P's prefix hit. Each answer's tokens and
logprobs are compared with the same messages sent to P alone as a plain
request. Both engines' start-up self-checks must pass. Then the load suite's
mixed requests (both endpoints, streamed and not, prompts of 2 to ~990
tokens, each sent several times) run 16 at a time: repeats D holds go to D
alone, the rest P/D, and every answer must equal P alone's.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest

from pdkv.proxy.config import build_config
from pdkv.proxy.server import BackgroundProxy
from pdkv.tinymodel import sample_text

from support.loadclient import ENDPOINTS, PROMPTS, Case, mixed_cases, run_load, same_greedy_answer
from support.ports import free_port_pair
from support.waiting import wait_for

pytestmark = pytest.mark.e2e
SYSTEM = sample_text(220, seed=5)
LOGPROB_TOLERANCE = 0.02  # P alone computes the prompt in one pass, D alone after its cached prefix: bf16 noise


def answer(url: str, model: str, messages: list[dict], request_id: str | None = None) -> tuple[list[str], list[float]]:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True}
    headers = {"X-Request-Id": request_id} if request_id else {}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=180)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    return [c["token"] for c in content], [c["logprob"] for c in content]


def same(a: tuple[list[str], list[float]], b: tuple[list[str], list[float]]) -> None:
    assert a[0] == b[0]
    assert all(math.isclose(x, y, abs_tol=LOGPROB_TOLERANCE) for x, y in zip(a[1], b[1], strict=True)), (a[1], b[1])


def test_kv_aware_answers_equal_p_alone_on_pd_and_on_d_alone(start_vllm, tiny_model):
    model = str(tiny_model)
    bport, p_events, d_events = free_port_pair(), free_port_pair(), free_port_pair()
    prefill, decode = start_vllm.pair(
        dict(role="prefill", transport="cma", omp_bind="0", bootstrap_port=bport, kv_events_port=p_events, name="kv-prefill"),
        dict(role="decode", transport="cma", omp_bind="1", kv_events_port=d_events, name="kv-decode"),
    )
    events = [f"{prefill.url}=tcp://127.0.0.1:{p_events}", f"{decode.url}=tcp://127.0.0.1:{d_events}"]
    cfg = build_config([f"{prefill.url},{bport}"], [decode.url], port=0, policy="kv-aware", health_interval=0.5,
                       kv={"events": events, "local_prefill_tokens": 128})
    with BackgroundProxy(cfg) as proxy:
        kv = proxy.app.router
        wait_for(lambda: len(kv.self_checks) == 2, timeout=60, what="both self-checks")
        assert set(kv.self_checks.values()) == {"ok"}, kv.self_checks

        history = [{"role": "system", "content": SYSTEM}]
        routes = []
        for turn in range(4):
            history.append({"role": "user", "content": sample_text(30, seed=100 + turn)})
            rid = f"kv-turn-{turn}-{time.time_ns()}"
            got = answer(proxy.url, model, history, rid)
            same(got, answer(prefill.url, model, history))
            t = proxy.app.timings.get(rid)
            routes.append((t.local_prefill, t.route))
            history.append({"role": "assistant", "content": "".join(got[0])})
            time.sleep(0.3)  # D's events for this turn's blocks
        assert routes[0][0] is None and routes[0][1].startswith(("least_cost", "prefix_hit")), routes[0]
        assert all(local == "kv_local" and route.startswith("local_prefill") for local, route in routes[1:]), routes

        # Another chat under the same system prompt: P/D, with P holding the shared prefix.
        other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sample_text(200, seed=999)}]
        rid = f"kv-other-{time.time_ns()}"
        same(answer(proxy.url, model, other, rid), answer(prefill.url, model, other))
        t = proxy.app.timings.get(rid)
        assert t.local_prefill is None and t.route.startswith("prefix_hit"), t.route

        metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
        assert 'pdkv_proxy_kv_route_total{reason="local_prefill"} 3.0' in metrics
        assert 'pdkv_proxy_local_prefill_total{reason="kv_local"} 3.0' in metrics
        assert f'pdkv_proxy_kv_self_check{{engine="{decode.url}"}} 1.0' in metrics
        assert 'pdkv_proxy_kv_hit_tokens_total{engine="' in metrics
        assert "pdkv_proxy_kv_event_lag_seconds_count" in metrics

        # The engines' own /metrics, as the proxy reads them: D's load in its cost, D's own prefix hits (the later
        # turns found the history in its cache) beside the proxy's predictions.
        def engine_hits(url: str) -> float:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))

        def read(name: str, engine: str) -> float:
            return proxy.app.metrics.registry.get_sample_value(name, {"engine": engine}) or 0.0

        wait_for(lambda: read("pdkv_proxy_kv_engine_hit_tokens_total", decode.url) > 0, timeout=10, what="D's own hits read by the proxy")
        assert read("pdkv_proxy_kv_engine_hit_tokens_total", decode.url) <= engine_hits(decode.url)
        def idle_reading() -> bool:  # a reading taken after the last request ended
            load = kv.load(decode.url, time.monotonic())
            assert load is not None and 0.0 <= load.kv_usage <= 1.0
            return load.requests == 0

        wait_for(idle_reading, timeout=10, what="a reading of D with no request")
        assert read("pdkv_proxy_kv_engine_query_tokens_total", prefill.url) > 0

        # Under load: many requests in flight, each routed by the cost model (D alone, P/D by prefix or by load).
        refs = [Case(e, p, stream=False) for e in ENDPOINTS for p in PROMPTS]
        alone = dict(zip(refs, asyncio.run(run_load(prefill.url, refs, model, 4, top=2)), strict=True))
        cases = mixed_cases(64, seed=18)
        answers = asyncio.run(run_load(proxy.url, cases, model, 16))
        failed = [(c, a.status, a.error) for c, a in zip(cases, answers, strict=True) if a.status != 200 or a.error]
        assert not failed, failed[:3]
        wrong = [(c.endpoint, len(c.prompt.split()), why) for c, a in zip(cases, answers, strict=True)
                 if (why := same_greedy_answer(a, alone[Case(c.endpoint, c.prompt, stream=False)])) is not None]
        assert not wrong, wrong[:3]
        served = proxy.app.timings.recent(len(cases))  # the newest records: the load's
        assert len(served) == len(cases) and all(t.route for t in served)
        assert any(t.local_prefill == "kv_local" for t in served) and any(t.local_prefill is None for t in served), \
            [t.route for t in served][:5]

"""Load through a real local 1P1D (tiny model, CPU): many requests in flight, nothing lost, nothing leaked.

For each deployment (pdkv's connector over cma, over Mooncake tcp and over
its own TCP (socket), the last also with P writing layer by layer during its
forward (socket_write_layers), vLLM's MooncakeConnector behind the test-only CPU
accelerator shim): completions and chat, streaming and not, prompts of 2 to ~1000
tokens, at concurrency 1, 8 and 32. Every request must succeed and every
greedy answer must equal the one P alone gives for the same prompt (KV
written into another request's blocks shows up as a different answer).
Afterwards both engines' KV cache usage must be back to 0 within 10 s,
also after a third of the streams were cut at random points and after a
storm of 200 client disconnects. On the same deployments, one request of each
kind: the proxy is ready once P's bootstrap names an engine; streaming and
non-streaming completions and chat completions come back from D with the
requested number of tokens; per-request timings are recorded; and a client
request whose stop_token_ids hold P's own greedy token answers at once (P's
copy drops them and carries min_tokens 1, so P finishes by length and sends
its KV instead of leaving D waiting 480 s).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import httpx
import pytest

from support import loadclient
from support.loadclient import ENDPOINTS, PROMPTS, Answer, Case, kv_usage, mixed_cases, one, prompts, run_load, same_greedy_answer
from support.ports import free_port
from pdkv.deploy.run.process import ManagedProcess
from pdkv.proxy.config import build_config
from pdkv.proxy.server import BackgroundProxy

pytestmark = pytest.mark.e2e

# name -> (connector, transport, P's kv_connector_extra_config beside the transport's)
DEPLOYMENTS = {"pdkv-cma": ("pdkv", "cma", {}), "pdkv-tcp": ("pdkv", "tcp", {}), "pdkv-socket": ("pdkv", "socket", {}),
               # the tiny model's 2 layers in one group, as a real model's 36 go in 6 (one write a layer: integration)
               "pdkv-socket-layers": ("pdkv", "socket", {"socket_write_layers": True, "socket_layer_groups": 1}),
               "vllm-mooncake-tcp": ("mooncake", "tcp", {})}


@dataclass
class Deployment:
    name: str
    prefill: ManagedProcess
    decode: ManagedProcess
    proxy_url: str
    model: str
    alone: dict[tuple[str, str], Answer]  # (endpoint, prompt) -> P alone's greedy answer
    bootstrap_url: str = ""


def assert_no_blocks_held(dep: Deployment, within_s: float = 10.0) -> None:
    end = time.monotonic() + within_s
    usage = {}
    while time.monotonic() < end:
        usage = {"prefill": kv_usage(dep.prefill.url), "decode": kv_usage(dep.decode.url)}
        if not any(usage.values()):
            return
        time.sleep(0.25)
    raise AssertionError(f"{dep.name}: KV cache still in use {within_s:g} s after the load: {usage}")


# vLLM's MooncakeConnector under load in the extended tier (README, "Tests"): pdkv's proxy with it is
# tests/e2e/test_connector_pd.py's "mooncake", and Mooncake tcp under load is pdkv-tcp's here.
EXTENDED = {"vllm-mooncake-tcp"}


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.extended) if n in EXTENDED else n for n in DEPLOYMENTS],
                ids=list(DEPLOYMENTS))
def deployment(request, start_vllm, tiny_model) -> Iterator[Deployment]:
    connector, transport, p_extra = DEPLOYMENTS[request.param]
    shim = connector == "mooncake"
    bootstrap_port = free_port()
    prefill, decode = start_vllm.pair(
        dict(role="prefill", connector=connector, transport=transport, omp_bind="0", bootstrap_port=bootstrap_port,
             cpu_accelerator_shim=shim, name=f"load-prefill-{request.param}", connector_extra=p_extra),
        dict(role="decode", connector=connector, transport=transport, omp_bind="1", cpu_accelerator_shim=shim,
             name=f"load-decode-{request.param}"),
    )
    model = str(tiny_model)
    # P alone: the same engine asked directly, as a plain request (no kv_transfer_params), top two logprobs for ties.
    refs = [Case(e, p, stream=False) for e in ENDPOINTS for p in PROMPTS]
    answers = asyncio.run(run_load(prefill.url, refs, model, 4, top=2))
    for case, a in zip(refs, answers, strict=True):
        assert a.status == 200 and len(a.tokens) == 8, (case, a)
    cfg = build_config([f"{prefill.url},http://127.0.0.1:{bootstrap_port}"], [decode.url], port=0, health_interval=0.5,
                       prefill_timeout=60, decode_first_byte_timeout=90, connector=connector)
    with BackgroundProxy(cfg) as proxy:
        end = time.monotonic() + 30
        while httpx.get(f"{proxy.url}/health", trust_env=False).status_code != 200:
            assert time.monotonic() < end, "proxy not ready"
            time.sleep(0.2)
        yield Deployment(request.param, prefill, decode, proxy.url, model,
                         {(c.endpoint, c.prompt): a for c, a in zip(refs, answers, strict=True)}, f"http://127.0.0.1:{bootstrap_port}")
    # Free the two cores for the next deployment.
    decode.stop(grace=15)
    prefill.stop(grace=15)


def check_answers(dep: Deployment, cases: list[Case], answers: list[Answer]) -> None:
    failed = [(c.endpoint, c.stream, len(c.prompt.split()), a.status, a.error) for c, a in zip(cases, answers, strict=True)
              if a.status != 200 or a.error]
    assert not failed, f"{dep.name}: {len(failed)} of {len(cases)} requests failed, e.g. {failed[:3]}"
    wrong = []
    for c, a in zip(cases, answers, strict=True):
        why = same_greedy_answer(a, dep.alone[(c.endpoint, c.prompt)])
        if why is not None:
            wrong.append((c.endpoint, c.stream, len(c.prompt.split()), why))
    assert not wrong, f"{dep.name}: {len(wrong)} of {len(cases)} answers differ from P alone's, e.g. {wrong[:3]}"


@pytest.mark.parametrize("concurrency,n", [(1, 8), (8, 32), (32, 96)])
def test_every_answer_under_load_equals_p_alone(deployment, concurrency, n):
    cases = mixed_cases(n, seed=concurrency)
    answers = asyncio.run(run_load(deployment.proxy_url, cases, deployment.model, concurrency))
    check_answers(deployment, cases, answers)
    assert_no_blocks_held(deployment)


def p_traces(bootstrap_url: str) -> list:
    """Every transfer record of every prefill worker registered at `bootstrap_url` (their side channels' StatsReply)."""
    from pdkv.bootstrap import BootstrapClient
    from pdkv.wire import query_stats

    with BootstrapClient(bootstrap_url, timeout=2.0, retries=1) as bs:
        addrs = [a for entry in bs.query().values() for pps in entry.worker_addr.values() for a in pps.values()]

    async def ask_all() -> list:
        return list(await asyncio.gather(*(query_stats(a) for a in addrs)))

    return [t for reply in asyncio.run(ask_all()) for t in reply.traces]


def test_writes_layer_by_layer_ran_beside_ps_forward(deployment):
    # Fresh long prompts (no prefix cache holds them), 8 in flight, until one of P's writes began inside the forward
    # computing its prompt: D's pull was there first (bounded: a few rounds). Their answers equal P alone's.
    if not DEPLOYMENTS[deployment.name][2].get("socket_write_layers"):
        pytest.skip("P writes once after its forward here")
    inside, rounds = [], 0
    while not inside and rounds < 6:
        cases = [Case(ENDPOINTS[0], text, stream=bool(i % 2)) for i, text in enumerate(prompts(1000 + rounds, [270] * 8))]
        answers = asyncio.run(run_load(deployment.proxy_url, cases, deployment.model, 8))
        alone = asyncio.run(run_load(deployment.prefill.url, [Case(c.endpoint, c.prompt, stream=False) for c in cases],
                                     deployment.model, 4, top=2))
        check_answers(with_reference(deployment, cases, alone), cases, answers)
        sent = [t for t in p_traces(deployment.bootstrap_url) if t.status == "sent" and "p_forward_done" in t.events]
        inside = [t for t in sent if t.events["transfer_start"] < t.events["p_forward_done"]]
        rounds += 1
    assert inside, f"none of P's writes began inside its forward after {rounds} rounds of 8 fresh prompts"
    assert_no_blocks_held(deployment)


def with_reference(dep: Deployment, cases: list[Case], alone: list[Answer]) -> Deployment:
    """`dep` with P alone's answers for `cases` as its reference."""
    return replace(dep, alone={(c.endpoint, c.prompt): a for c, a in zip(cases, alone, strict=True)})


def test_streams_cut_at_random_points_leak_no_blocks(deployment):
    cases = mixed_cases(96, seed=99, cancel_share=0.67)  # a third of all requests: two thirds of the streams
    assert sum(c.cancel_after is not None for c in cases) >= 24
    answers = asyncio.run(run_load(deployment.proxy_url, cases, deployment.model, 32))
    check_answers(deployment, cases, answers)
    assert_no_blocks_held(deployment)


def test_a_storm_of_200_disconnects_leaves_the_deployment_serving(deployment):
    async def storm() -> None:
        async with httpx.AsyncClient(timeout=30, trust_env=False) as client:

            async def hang_up(i: int) -> None:
                case = Case(ENDPOINTS[i % 2], PROMPTS[i % len(PROMPTS)], stream=bool(i % 3))
                try:
                    # Gone before the answer: some before P answers, some while D streams.
                    await asyncio.wait_for(one(client, deployment.proxy_url, case, deployment.model), timeout=0.05 + (i % 10) * 0.03)
                except TimeoutError:
                    pass

            await asyncio.gather(*(hang_up(i) for i in range(200)))

    asyncio.run(storm())
    cases = mixed_cases(16, seed=5)
    check_answers(deployment, cases, asyncio.run(run_load(deployment.proxy_url, cases, deployment.model, 8)))
    assert_no_blocks_held(deployment)


def prompt_tokens_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:prompt_tokens_total"))


def _choices(r: httpx.Response) -> dict[int, list[int]]:
    out = {}
    for choice in r.json()["choices"]:
        got = Answer()
        loadclient._take_logprobs(choice, got)
        out[choice["index"]] = got.tokens
    return out


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_n_2_gives_two_choices_from_one_prefill(deployment, endpoint):
    # vLLM samples n > 1 only with a temperature; a seed makes each choice reproducible (choice i uses seed + i).
    body = loadclient.body_of(Case(endpoint, PROMPTS[3], stream=False), deployment.model) | {"n": 2, "temperature": 1.0, "seed": 1234}
    before = prompt_tokens_total(deployment.prefill.url)
    r = httpx.post(deployment.proxy_url + endpoint, json=body, timeout=120, trust_env=False)
    if DEPLOYMENTS[deployment.name][0] == "mooncake":
        # vLLM's connector sends a transfer to one D request: the proxy says so instead of leaving a choice waiting.
        assert r.status_code == 400 and "n > 1" in r.json()["error"]["message"], r.text
        return
    assert r.status_code == 200, r.text
    # One prefill on P: its prompt-token counter grew by one prompt, not two.
    assert prompt_tokens_total(deployment.prefill.url) - before == r.json()["usage"]["prompt_tokens"]
    alone = httpx.post(deployment.prefill.url + endpoint, json=body, timeout=120, trust_env=False)
    assert alone.status_code == 200, alone.text
    assert _choices(r) == _choices(alone) and len(_choices(r)) == 2
    assert all(len(tokens) == 8 for tokens in _choices(r).values())
    assert_no_blocks_held(deployment)


def _greedy_token_id(prefill_url: str, model: str, prompt: str) -> int:
    """P's own first greedy token for `prompt`, asked of P directly as a plain (non-P/D) request."""
    r = httpx.post(f"{prefill_url}/v1/completions", timeout=120, trust_env=False, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True,
    })
    r.raise_for_status()
    return int(r.json()["choices"][0]["logprobs"]["tokens"][0].split(":", 1)[1])


def test_each_kind_of_request_is_served_and_a_stop_token_never_hangs(deployment):
    prompt, d_tokens, model = "The proxy sends the prompt to prefill and the rest to decode", 8, deployment.model
    with httpx.Client(base_url=deployment.proxy_url, timeout=120, trust_env=False) as c:
        engines = c.get("/health").json()["backends"][0]["engines"]
        assert engines and all(engines.values())

        body = {"model": model, "prompt": prompt, "max_tokens": d_tokens, "temperature": 0, "ignore_eos": True}
        plain = c.post("/v1/completions", json=body, headers={"X-Request-Id": f"e2e-plain-{deployment.name}"})
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] == d_tokens

        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 2
        assert all('"error"' not in e for e in events)

        chat = c.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": 4, "temperature": 0,
        })
        assert chat.status_code == 200, chat.text

        # The known hang: P's only token is a stop token. Through pdkv it must not wait 480 s.
        stop_id = _greedy_token_id(deployment.prefill.url, model, prompt)
        start = time.monotonic()
        stopped = c.post("/v1/completions", json={**body, "ignore_eos": False, "stop_token_ids": [stop_id], "stop": ["\n\n"]},
                         headers={"X-Request-Id": f"e2e-stop-{deployment.name}"})
        elapsed = time.monotonic() - start
        assert stopped.status_code == 200, stopped.text
        assert elapsed < 60, f"a stop-token request took {elapsed:.0f} s: D waited for KV"

        timing = c.get(f"/pdkv/requests/e2e-plain-{deployment.name}").json()
        assert timing["status"] == 200 and timing["prefill_status"] == 200
        assert timing["received"] <= timing["prefill_responded"] <= timing["last_byte"]
        stop_tid = c.get(f"/pdkv/requests/e2e-stop-{deployment.name}").json()["transfer_id"]
        assert c.get(f"/pdkv/requests/{stop_tid}").json()["status"] == 200
        metrics = c.get("/metrics").text
        assert 'pdkv_proxy_requests_total{status="200"}' in metrics
        assert "pdkv_proxy_prefill_seconds_count" in metrics

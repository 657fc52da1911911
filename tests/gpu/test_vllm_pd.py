"""Real vLLM on a GPU: 1P1D deployments started by `pdkv up -f`, P and D sharing GPU 0 (tests/gpu/deployments.py).

pdkv's connector over CUDA IPC and over Mooncake tcp, and vLLM's MooncakeConnector over Mooncake tcp, each
serving a Qwen3-architecture model at Qwen3-8B's size (seeded random weights: `pdkv model random`) through
pdkv's proxy. Greedy answers equal P alone's (batch-invariant kernels on both engines), or leave it only at a
bf16 tie of P alone's top two logits (tests/support/greedy.py says why one can fall either way); the seed's request is
traced (63 blocks, 148,635,648 bytes over 36 layers); the engines' KV usage returns to 0; P killed under
load leaves no request unanswered.

Needs PDKV_GPU_MODEL (the model folder); with PDKV_GPU_UP set the deployments are already running
(scripts/gpu/run.sh starts them for the tests and the benchmark), otherwise these tests start them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from support.greedy import same_tokens, tie_verdict

from tests.gpu import deployments as deps

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("PDKV_GPU_MODEL", "")
SERVED = "qwen3-8b-random"
VOCAB = 151936
SEED_PROMPT, SEED_OUTPUT = 1000, 128  # the seed's request
SEED_BYTES = 148_635_648  # 63 blocks x 36 layers x 64 KiB
OUT = Path(os.environ["PDKV_GPU_OUT"]) if os.environ.get("PDKV_GPU_OUT") else None
REQUEST_TIMEOUT_S = 120.0


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def complete(url: str, ids: list[int], max_tokens: int, *, stream: bool = False) -> str:
    """The greedy completion's text (its tokens are `t<id>` words, so equal text is equal tokens)."""
    body = {"model": SERVED, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S, trust_env=False)
        assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:300]}"
        return r.json()["choices"][0]["text"]
    parts = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S, trust_env=False) as r:
        assert r.status_code == 200, f"{url}: {r.status_code} {r.read()[:300]!r}"
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts += [c.get("text", "") for c in json.loads(line[6:])["choices"]]
    return "".join(parts)


Alone = tuple[list[str], list[dict[str, float]]]


def alone(url: str, ids: list[int], max_tokens: int) -> Alone:
    """P alone's greedy tokens and its top-2 log-probabilities at each."""
    body = {"model": SERVED, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S, trust_env=False)
    assert r.status_code == 200, f"{url}: {r.status_code} {r.text[:300]}"
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["top_logprobs"]


def differences(name: str, got: list[str], want: list[Alone], prompts: list[list[int]]) -> list[str]:
    """Why each P/D answer is not P alone's (tests/support/greedy.py's rule); near-ties are noted in OUT/ties.jsonl."""
    wrong = []
    for i, (g, (tokens, top)) in enumerate(zip(got, want, strict=True)):
        why = tie_verdict(g.split(), tokens, top)
        if why is not None:
            wrong.append(f"request {i} ({len(prompts[i])} prompt tokens): {why}")
        elif OUT is not None and not same_tokens(g.split(), tokens):
            with (OUT / "ties.jsonl").open("a") as f:
                f.write(json.dumps({"deployment": name, "prompt_tokens": len(prompts[i]), "tokens": len(tokens)}) + "\n")
    return wrong


def kv_usage(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    values = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:kv_cache_usage_perc")]
    assert values, f"{url}/metrics has no vllm:kv_cache_usage_perc"
    return max(values)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, deps.Running]]:
    if not MODEL or not (Path(MODEL) / "config.json").is_file():
        pytest.skip("PDKV_GPU_MODEL names no model folder (pdkv model random DIR --config ...; scripts/gpu/run.sh writes one)")
    pytest.importorskip("vllm")
    if os.environ.get("PDKV_GPU_UP"):
        yield {name: deps.attach(name) for name in deps.ACTIVE}
        return
    folder = tmp_path_factory.mktemp("gpu-deployments")
    files = deps.write_files(MODEL, folder)
    runs = [deps.start(name, files[name], folder / f"{name}.stderr") for name in deps.ACTIVE]
    try:
        deps.wait_ready(runs)
        yield {r.name: r for r in runs}
    finally:
        for r in runs:
            deps.stop(r)


@pytest.fixture(params=deps.ACTIVE)
def dep(request: pytest.FixtureRequest, running: dict[str, deps.Running]) -> deps.Running:
    return running[request.param]


@pytest.mark.parametrize("length", [1, 17, 1000])
def test_greedy_answer_equals_p_alone(dep: deps.Running, length: int) -> None:
    ids = prompt_ids(length, seed=length + 1000 * deps.NAMES.index(dep.name))
    got = complete(dep.proxy, ids, 16)
    want = alone(dep.prefill, ids, 16)
    assert not differences(dep.name, [got], [want], [ids]), f"{dep.name}: P/D {got!r} != P alone {want[0]!r}"
    assert len(got.split()) == 16


def test_sixteen_mixed_requests_in_flight(dep: deps.Running) -> None:
    rng = random.Random(dep.name)
    cases = [(prompt_ids(rng.choice([1, 5, 17, 64, 300, 1000, 1500]), seed=7000 + i), rng.choice([1, 8, 32]), i % 3 == 0)
             for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda c: complete(dep.proxy, c[0], c[1], stream=c[2]), cases))
    want = [alone(dep.prefill, ids, n) for ids, n, _ in cases]
    wrong = differences(dep.name, got, want, [c[0] for c in cases])
    if wrong:  # say whether P alone itself answers otherwise under the same load (then the engine, not the KV)
        with ThreadPoolExecutor(16) as pool:
            alone_loaded = list(pool.map(lambda c: complete(dep.prefill, c[0], c[1]), cases))
        loaded_wrong = differences(dep.name, alone_loaded, want, [c[0] for c in cases])
        raise AssertionError(f"{dep.name}: {len(wrong)} of 16 differ from P alone's: {wrong[0]}; P alone with 16 in flight "
                             f"differs from P alone for {len(loaded_wrong)}")


def test_seed_request_trace(dep: deps.Running) -> None:
    if not dep.name.startswith("pdkv"):
        pytest.skip("vLLM's MooncakeConnector records no transfer for pdkv trace")
    from pdkv.geometry import geometry_from_model, size_transfer
    from pdkv.trace import run_trace

    prompt = " ".join(f"t{i}" for i in prompt_ids(SEED_PROMPT, seed=424242 + len(dep.name)))
    trace = run_trace(dep.proxy, prompt=prompt, max_tokens=SEED_OUTPUT, link_gbps=400)
    if OUT is not None:
        import msgspec

        (OUT / f"trace-{dep.name}.json").write_bytes(msgspec.json.encode(trace))
    assert trace.connector_visible, trace.notes
    assert trace.prompt_tokens == SEED_PROMPT and trace.completion_tokens == SEED_OUTPUT
    plan = size_transfer(geometry_from_model(MODEL), prompt_tokens=SEED_PROMPT, block_size=deps.BLOCK_SIZE)
    assert plan.blocks == 63 and plan.transfer_bytes == SEED_BYTES
    t = trace.transfer
    assert t is not None and t.status == "sent", t
    assert t.bytes == SEED_BYTES
    assert t.descriptors % 36 == 0 and t.descriptors >= 36, t.descriptors  # every layer's region, runs coalesced
    assert t.write_ms is not None and t.write_ms > 0 and t.achieved_gbps is not None and t.achieved_gbps > 0
    assert trace.client_ttft_ms is not None and abs(trace.phases_ms - trace.client_ttft_ms) <= 0.05 * trace.client_ttft_ms


def test_kv_usage_returns_to_zero(dep: deps.Running) -> None:
    deadline = time.monotonic() + 30
    while (usage := (kv_usage(dep.prefill), kv_usage(dep.decode))) != (0.0, 0.0):
        assert time.monotonic() < deadline, f"{dep.name}: KV usage (P, D) still {usage} 30 s after the last request"
        time.sleep(0.5)


def _kill_engine(url: str) -> list[int]:
    """SIGKILL the vLLM server listening at `url` and every process under it; their pids."""
    port = int(url.rsplit(":", 1)[1])
    owners = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid}
    assert owners, f"nothing listens on {port}"
    victims = [psutil.Process(pid) for pid in owners]
    victims += [c for p in list(victims) for c in p.children(recursive=True)]
    for p in victims:
        p.send_signal(signal.SIGKILL)
    return [p.pid for p in victims]


@pytest.mark.parametrize("name", [n for n in deps.ACTIVE if n.startswith("pdkv-")])
def test_p_killed_under_load_every_request_answered(running: dict[str, deps.Running], name: str) -> None:
    dep = running[name]
    cases = [(prompt_ids(600 + 37 * i, seed=9100 + i), 24) for i in range(16)]
    want = [alone(dep.prefill, ids, n) for ids, n in cases]
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(complete, dep.proxy, ids, n) for ids, n in cases]
        time.sleep(0.3)
        killed = _kill_engine(dep.prefill)
        got = [f.result(timeout=REQUEST_TIMEOUT_S + 30) for f in futures]
    assert killed
    wrong = differences(name, got, want, [c[0] for c in cases])
    assert not wrong, f"{name}: after P was killed, {len(wrong)} of 16 answers differ from P alone's: {wrong[0]}"
    assert time.monotonic() - t0 < REQUEST_TIMEOUT_S

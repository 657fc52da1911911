"""Real vLLM against a standalone `pdkv bootstrap`.

vLLM's own MooncakeConnector (on CPU through the test-only accelerator shim)
is told `bootstrap_server_address`: its prefill worker registers with pdkv's
server, its decode worker finds the prefill through it, the liveness sweep
probes the live ZMQ side channel every second without disturbing it, and once
the prefill is stopped the sweep drops it.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.e2e

SWEEP_S = 1.0
SWEEP_FAILURES = 3
D_TOKENS = 8


@pytest.fixture
def standalone_bootstrap():
    """`pdkv bootstrap` in its own process, sweeping every second; yields its URL."""
    cmd = [sys.executable, "-m", "pdkv", "bootstrap", "--port", "0", "--json",
           "--probe-interval", str(SWEEP_S), "--probe-failures", str(SWEEP_FAILURES)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=20), "pdkv bootstrap did not start within 20 s"
        yield json.loads(proc.stdout.readline())["url"]
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def metric(url: str, name: str) -> int:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.rsplit(" ", 1)[1]))  # prometheus_client writes counts as floats
    raise AssertionError(f"{name} not in {url}/metrics")


def completion(url: str, body: dict, request_id: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=120)
    r.raise_for_status()
    return r.json()


def test_vllm_mooncake_connector_registers_and_resolves_through_pdkv_bootstrap(start_vllm, tiny_model, standalone_bootstrap):
    bootstrap = standalone_bootstrap
    prefill, decode = start_vllm.pair(
        dict(role="prefill", connector="mooncake", bootstrap_url=bootstrap, omp_bind="0", cpu_accelerator_shim=True,
             name="bootstrap-e2e-prefill"),
        dict(role="decode", connector="mooncake", omp_bind="1", cpu_accelerator_shim=True, name="bootstrap-e2e-decode"),
    )
    # P's worker registered before vLLM reported healthy (register_kv_caches waits for it).
    registry = httpx.get(f"{bootstrap}/query", timeout=5).json()
    assert list(registry) == ["0"]
    engine_id = registry["0"]["engine_id"]
    side_channel = registry["0"]["worker_addr"]["0"]["0"]
    assert set(registry["0"]["worker_addr"]) == {"0"} and side_channel.startswith("tcp://127.0.0.1:")
    assert metric(bootstrap, 'pdkv_bootstrap_registrations_total{result="created"}') == 1

    queries_before = metric(bootstrap, "pdkv_bootstrap_queries_total")
    model = str(tiny_model)
    prompt = "Prefill the cache block and send every token to decode"
    request_id = f"bootstrap-e2e-{uuid.uuid4().hex[:8]}"
    transfer_id = f"xfer-{request_id}"
    p_body = {
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id},
    }
    d_body = {
        "model": model, "prompt": prompt, "max_tokens": D_TOKENS, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {
            "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
            "remote_bootstrap_addr": bootstrap, "remote_engine_id": engine_id,
        },
    }
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        p_future = pool.submit(completion, prefill.url, p_body, request_id)
        d_future = pool.submit(completion, decode.url, d_body, request_id)
        p_answer, d_answer = p_future.result(timeout=150), d_future.result(timeout=150)
    elapsed = time.monotonic() - start

    assert elapsed < 60, f"P/D request took {elapsed:.1f} s: D waited for KV that did not come"
    assert d_answer["usage"]["completion_tokens"] == D_TOKENS
    assert d_answer["choices"][0]["text"].startswith(p_answer["choices"][0]["text"])
    # D's worker resolved P through pdkv's server, and found it.
    assert metric(bootstrap, "pdkv_bootstrap_queries_total") > queries_before
    d_log = decode.log_tail(400)
    assert "not found from bootstrap" not in d_log and "Failed to connect to bootstrap" not in d_log

    # Dozens of sweeps have probed P's live ZMQ ROUTER since it registered; it is still listed and still serves.
    assert metric(bootstrap, "pdkv_bootstrap_evictions_total") == 0
    assert httpx.get(f"{bootstrap}/query", timeout=5).json() == registry
    completion(prefill.url, {**p_body, "kv_transfer_params": None}, f"{request_id}-again")

    # A dead prefill is not served forever.
    prefill.stop(grace=15)
    deadline = time.monotonic() + SWEEP_S * (SWEEP_FAILURES + 3) + 5
    while time.monotonic() < deadline and httpx.get(f"{bootstrap}/query", timeout=5).json():
        time.sleep(0.2)
    assert httpx.get(f"{bootstrap}/query", timeout=5).json() == {}
    assert metric(bootstrap, "pdkv_bootstrap_evictions_total") == 1

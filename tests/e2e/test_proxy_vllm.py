"""pdkv proxy in front of a real vLLM P/D pair on the tiny model (CPU, Mooncake tcp).

For each connector (vLLM's own MooncakeConnector through the test-only CPU
accelerator shim, and pdkv's connector): the proxy becomes ready only once P's
bootstrap names an engine; streaming and non-streaming completions and chat
completions come back from D with the requested number of tokens; per-request
timings are recorded; and a client request whose stop_token_ids hold P's own
greedy token answers at once (P's copy drops them and carries min_tokens 1,
so P finishes by length and sends its KV instead of leaving D waiting 480 s).
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from pdkv.proxy.routing import build_config
from pdkv.proxy.server import BackgroundProxy
pytestmark = pytest.mark.e2e

PROMPT = "The proxy sends the prompt to prefill and the rest to decode"
D_TOKENS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=["mooncake", "pdkv"])
def pd_pair(request, start_vllm):
    connector = request.param
    shim = connector == "mooncake"
    bootstrap_port = free_port()
    prefill = start_vllm(role="prefill", connector=connector, omp_bind="0", bootstrap_port=bootstrap_port,
                         cpu_accelerator_shim=shim, name=f"proxy-e2e-prefill-{connector}")
    decode = start_vllm(role="decode", connector=connector, omp_bind="1", cpu_accelerator_shim=shim,
                        name=f"proxy-e2e-decode-{connector}")
    return prefill, decode, f"http://127.0.0.1:{bootstrap_port}"


def _wait_ready(client: httpx.Client, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if client.get("/health").status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError(f"proxy not ready: {client.get('/health').json()}")


def _greedy_token_id(prefill_url: str, model: str) -> int:
    """P's own first greedy token for PROMPT, asked of P directly as a plain (non-P/D) request."""
    r = httpx.post(f"{prefill_url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1,
        "return_tokens_as_token_ids": True,
    })
    r.raise_for_status()
    token = r.json()["choices"][0]["logprobs"]["tokens"][0]
    return int(token.split(":", 1)[1])


def test_proxy_serves_real_pd_and_never_hangs_on_stop_tokens(pd_pair, tiny_model):
    prefill, decode, bootstrap = pd_pair
    model = str(tiny_model)
    cfg = build_config([f"{prefill.url},{bootstrap}"], [decode.url], port=0, health_interval=0.5,
                       prefill_timeout=60, decode_first_byte_timeout=90)
    with BackgroundProxy(cfg) as proxy, httpx.Client(base_url=proxy.url, timeout=120, trust_env=False) as c:
        _wait_ready(c)
        engines = c.get("/health").json()["backends"][0]["engines"]
        assert engines and all(engines.values())

        body = {"model": model, "prompt": PROMPT, "max_tokens": D_TOKENS, "temperature": 0, "ignore_eos": True}
        plain = c.post("/v1/completions", json=body, headers={"X-Request-Id": "e2e-plain"})
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] == D_TOKENS

        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 2
        assert all('"error"' not in e for e in events)

        chat = c.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 4,
            "temperature": 0,
        })
        assert chat.status_code == 200, chat.text

        # The known hang: P's only token is a stop token. Through pdkv it must not wait 480 s.
        stop_id = _greedy_token_id(prefill.url, model)
        start = time.monotonic()
        stopped = c.post("/v1/completions", json={**body, "ignore_eos": False, "stop_token_ids": [stop_id],
                                                   "stop": ["\n\n"]}, headers={"X-Request-Id": "e2e-stop"})
        elapsed = time.monotonic() - start
        assert stopped.status_code == 200, stopped.text
        assert elapsed < 60, f"a stop-token request took {elapsed:.0f} s: D waited for KV"

        timing = c.get("/pdkv/requests/e2e-plain").json()
        assert timing["status"] == 200 and timing["prefill_status"] == 200
        assert timing["received"] <= timing["prefill_responded"] <= timing["last_byte"]
        stop_tid = c.get("/pdkv/requests/e2e-stop").json()["transfer_id"]
        assert c.get(f"/pdkv/requests/{stop_tid}").json()["status"] == 200
        metrics = c.get("/metrics").text
        assert 'pdkv_proxy_requests_total{status="200"}' in metrics
        assert "pdkv_proxy_prefill_seconds_count" in metrics

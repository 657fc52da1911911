"""A dead or broken prefill costs latency, never a request (tiny model, CPU, pdkv's connector).

- D recomputes what did not arrive: a P whose transfers all fail (P on
  Mooncake tcp, D on cma: every pull is refused) still answers every
  request through D (kv_load_failure_policy "recompute", pdkv up's default),
  each answer equal to P alone's, D's KV usage back to 0; with "fail" each
  request fails at once with a clear error instead.
- P killed (kill -9) while 8 clients stream, over cma, tcp and socket (and
  socket with P writing layer by layer during its forward): no
  client sees a failure (requests whose P died go to D alone), every answer
  equals P alone's; while P is down D answers alone (the request record
  says so, with its TTFT); once P is back the proxy disaggregates again.
- D killed (kill -9) while 8 clients stream: each request in flight ends
  within 5 s with a clear error naming the decode stage, P holds no blocks
  for them 10 s later, and D serves again once it is back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from support.loadclient import Answer, Case, kv_usage, prompts, run_load, same_greedy_answer
from support.ports import free_port
from pdkv.deploy.run.process import ManagedProcess
from pdkv.proxy.config import build_config
from pdkv.proxy.server import BackgroundProxy

pytestmark = pytest.mark.e2e

PROMPTS = prompts(11, [3, 17, 60, 150, 260])
ENDPOINT = "/v1/completions"




def wait_usage_zero(url: str, within_s: float = 10.0) -> None:
    end = time.monotonic() + within_s
    while kv_usage(url) > 0:
        assert time.monotonic() < end, f"{url}: KV cache still in use {within_s:g} s after the load"
        time.sleep(0.25)


def restart_and_wait_routable(engine: ManagedProcess, proxy_url: str) -> None:
    """Start a killed engine again and wait (bounded) until the proxy routes to it."""
    engine.start()
    engine.wait_healthy(300)
    end = time.monotonic() + 30
    while httpx.get(f"{proxy_url}/health", trust_env=False).status_code != 200:
        assert time.monotonic() < end, f"{engine.name} not back in the proxy"
        time.sleep(0.25)


def transport_of(kind: str) -> tuple[str, dict]:
    """A test's kind of engine: its transport, and P's kv_connector_extra_config beside it ("socket-layers": socket,
    P writing layer by layer during its forward)."""
    transport, _, mode = kind.partition("-")
    return transport, ({"socket_write_layers": True} if mode == "layers" else {})


class Engines:
    """Prefill engines per kind (transport_of; core 0) and decode engines per transport (core 1), with P alone's
    answers."""

    def __init__(self, start_vllm, model: str) -> None:
        self.start_vllm = start_vllm
        self.model = model
        self.bootstrap: dict[str, int] = {}
        self.alone: dict[str, Answer] = {}

    def _prefill_args(self, kind: str) -> dict:
        port = self.bootstrap.setdefault(kind, free_port())
        transport, p_extra = transport_of(kind)
        extra = {"connector_extra": p_extra} if p_extra else {}
        return dict(role="prefill", transport=transport, omp_bind="0", bootstrap_port=port, name=f"recompute-prefill-{kind}", **extra)

    @staticmethod
    def _decode_args(kind: str, load_failure: str | None = None) -> dict:
        transport, _ = transport_of(kind)  # D is the same whatever P's kind
        extra = {"load_failure": load_failure} if load_failure else {}
        return dict(role="decode", transport=transport, omp_bind="1", name=f"recompute-decode-{transport}-{load_failure}", **extra)

    def prefill(self, transport: str) -> ManagedProcess:
        return self.start_vllm(**self._prefill_args(transport))

    def decode(self, transport: str, load_failure: str | None = None) -> ManagedProcess:
        return self.start_vllm(**self._decode_args(transport, load_failure))

    def pair(self, p_transport: str, d_transport: str) -> tuple[ManagedProcess, ManagedProcess]:
        """A P and a D started at once (different cores), as the tests below ask for them."""
        return self.start_vllm.pair(self._prefill_args(p_transport), self._decode_args(d_transport))

    @contextmanager
    def proxy(self, p_transport: str, decode: ManagedProcess, **config) -> Iterator[str]:
        p = self.prefill(p_transport)
        cfg = build_config([f"{p.url},http://127.0.0.1:{self.bootstrap[p_transport]}"], [decode.url], port=0, health_interval=0.5,
                           prefill_timeout=60, decode_first_byte_timeout=90, **config)
        with BackgroundProxy(cfg) as proxy:
            end = time.monotonic() + 30
            while httpx.get(f"{proxy.url}/health", trust_env=False).status_code != 200:
                assert time.monotonic() < end, "proxy not ready"
                time.sleep(0.2)
            yield proxy.url

    def reference(self, p: ManagedProcess) -> None:
        if self.alone:
            return
        refs = [Case(ENDPOINT, text, stream=False) for text in PROMPTS]
        for case, a in zip(refs, asyncio.run(run_load(p.url, refs, self.model, 4, top=2)), strict=True):
            assert a.status == 200 and len(a.tokens) == 8, a
            self.alone[case.prompt] = a

    def check(self, cases: list[Case], answers: list[Answer]) -> None:
        failed = [(a.status, a.error) for a in answers if a.status != 200 or a.error]
        assert not failed, f"{len(failed)} of {len(answers)} requests failed: {failed[:3]}"
        wrong = [why for c, a in zip(cases, answers, strict=True) if (why := same_greedy_answer(a, self.alone[c.prompt]))]
        assert not wrong, f"{len(wrong)} answers differ from P alone's: {wrong[:3]}"


@pytest.fixture(scope="module")
def engines(start_vllm, tiny_model) -> Engines:
    e = Engines(start_vllm, str(tiny_model))
    p, _ = e.pair("tcp", "cma")
    e.reference(p)
    return e


def streams(n: int) -> list[Case]:
    return [Case(ENDPOINT, PROMPTS[i % len(PROMPTS)], stream=True) for i in range(n)]


def test_every_failed_transfer_is_recomputed_on_decode(engines: Engines):
    # P moves KV over Mooncake tcp, D takes it over cma only: P refuses each pull, D computes the prompt itself.
    d = engines.decode("cma")
    with engines.proxy("tcp", d, local_fallback=False) as url:
        cases = streams(16)
        answers = asyncio.run(run_load(url, cases, engines.model, 8))
        engines.check(cases, answers)
        records = httpx.get(f"{url}/pdkv/requests", params={"limit": 16}, trust_env=False).json()
        assert all(r.get("local_prefill") is None for r in records)  # D recomputed: the proxy did nothing special
    log = d.log_path.read_text()
    assert "use the same mooncake_protocol on P and D" in log and "Recovered from KV load failure" in log
    wait_usage_zero(d.url)


def test_with_the_fail_policy_a_failed_transfer_fails_its_request_at_once(engines: Engines):
    d = engines.decode("cma", load_failure="fail")
    with engines.proxy("tcp", d, local_fallback=False) as url:
        answers = asyncio.run(run_load(url, streams(8), engines.model, 8))
    for a in answers:
        assert a.error and a.seconds < 5.0, a
        assert "mooncake_protocol" in a.error or "KV" in a.error, a.error
    wait_usage_zero(d.url)


# One kill in the main tier, over the socket transport (a cut connection is pdkv's own code to notice); the same kill
# over cma and Mooncake tcp, and with P writing layer by layer, in the extended tier (README, "Tests"): a peer gone
# mid-transfer on those is tests/integration's (test_transport_cma, test_transport_mooncake), and D's recompute the same.
@pytest.mark.parametrize("transport", ["socket", *(pytest.param(t, marks=pytest.mark.extended) for t in ("cma", "tcp", "socket-layers"))])
def test_prefill_killed_under_load_loses_no_request_then_comes_back(engines: Engines, transport: str):
    engines.pair(transport, transport)
    d = engines.decode(transport)
    with engines.proxy(transport, d) as url:
        p = engines.prefill(transport)
        cases = streams(320)  # 8 in flight, several seconds of load on 2 cores: the kill, 1 s in, lands inside it

        async def load_and_kill() -> list[Answer]:
            run = asyncio.ensure_future(run_load(url, cases, engines.model, 8))
            await asyncio.sleep(1.0)  # 8 streams in flight
            os.killpg(p.pid, signal.SIGKILL)
            return await run

        answers = asyncio.run(load_and_kill())
        p.proc.wait(10)
        engines.check(cases, answers)
        metrics = httpx.get(f"{url}/metrics", trust_env=False).text
        fell_back = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                        if line.startswith('pdkv_proxy_local_prefill_total{reason="prefill_failed"}'))
        assert fell_back >= 1, "the kill hit no request"  # requests whose P died were answered by D alone
        # P is down: D answers alone, and the request's record says so.
        time.sleep(1.5)  # a health round or two
        alone = [Case(ENDPOINT, PROMPTS[1], stream=True)]
        engines.check(alone, asyncio.run(run_load(url, alone, engines.model, 1)))
        rec = httpx.get(f"{url}/pdkv/requests", params={"limit": 1}, trust_env=False).json()[0]
        assert rec["local_prefill"] in ("no_prefill", "prefill_failed: prefill_connect") and rec["decode_first_byte"] > rec["received"]
        # P restarted: the proxy sends P/D requests again, without a restart of its own.
        restart_and_wait_routable(p, url)
        engines.check(alone, asyncio.run(run_load(url, alone, engines.model, 1)))
        rec = httpx.get(f"{url}/pdkv/requests", params={"limit": 1}, trust_env=False).json()[0]
        assert rec.get("local_prefill") is None and rec["prefill_dispatched"] and "error" not in rec
    wait_usage_zero(d.url)


def test_decode_killed_under_load_fails_fast_leaks_nothing_on_prefill_and_comes_back(engines: Engines):
    d = engines.decode("cma")
    with engines.proxy("cma", d) as url:
        p = engines.prefill("cma")
        cases = streams(320)  # 8 in flight, several seconds of load on 2 cores: the kill, 1 s in, lands inside it
        killed_at: list[float] = []

        async def load_and_kill() -> list[Answer]:
            run = asyncio.ensure_future(run_load(url, cases, engines.model, 8))
            await asyncio.sleep(1.0)  # 8 streams in flight
            os.killpg(d.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
            return await run

        start = time.monotonic()
        answers = asyncio.run(load_and_kill())
        d.proc.wait(10)
        for a in answers:  # each ended: whole, or with a clear error within 5 s of the kill
            if a.status != 200 or a.error:
                assert a.error and start + a.seconds - killed_at[0] < 5.0, a
                assert "decode" in a.error, a.error
        assert any(a.error for a in answers), "the kill hit no request"
        # P holds nothing for the requests D will never pull: the proxy released them.
        wait_usage_zero(p.url)
        restart_and_wait_routable(d, url)
        again = [Case(ENDPOINT, PROMPTS[2], stream=True)]
        engines.check(again, asyncio.run(run_load(url, again, engines.model, 1)))
    wait_usage_zero(d.url)

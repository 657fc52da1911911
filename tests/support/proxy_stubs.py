"""Stub P and D servers (real aiohttp servers on 127.0.0.1) behind a real bootstrap server and pdkv's proxy,
for the proxy's integration tests: `with Deployment() as dep: dep.client().post(...)`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import msgspec
from aiohttp import web

from pdkv.bootstrap import BootstrapClient, ProbePolicy, start_background
from pdkv.wire import RegisterRequest
from pdkv.proxy.config import build_config
from pdkv.proxy.server import BackgroundProxy
from pdkv.proxy_api import DrainAnswer, DrainRequest, PlannerView, RoleCounts
from pdkv.service import BackgroundService

REQUEST = {"model": "m", "prompt": "hello", "max_tokens": 16, "stream": True, "stop": ["\n\n"], "stop_token_ids": [7]}
EVENT = b'data: {"choices":[{"index":0,"text":"tok"}]}\n\n'


class Stub:
    """A P or D server whose behaviour a test changes between requests.

    behaviour keys: status (int), delay (s before answering), hang (never answer), hang_pd (never answer a
    P/D copy, one with kv_transfer_params),
    chunks (SSE events when streaming), gap (s between them), first_then_hang
    (stream one event, then wait), healthy (bool for /health), body (error body), prompt_tokens (an OpenAI usage
    in a non-streamed answer, as vLLM writes it), waiting (vllm:num_requests_waiting on /metrics).
    `seen` holds (headers, json body) per request; `cancelled` counts requests whose
    client (the proxy) went away before the answer was complete.
    """

    def __init__(self, name: str, host: str = "127.0.0.1") -> None:
        self.name = name
        self.behaviour: dict[str, Any] = {"status": 200, "delay": 0.0, "chunks": 3, "gap": 0.0, "healthy": True}
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.cancelled = 0
        self.completed = 0
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        self.service = BackgroundService(app, host)

    @property
    def url(self) -> str:
        return self.service.url

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if self.behaviour["healthy"] else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"model-from-{self.name}"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        waiting = self.behaviour.get("waiting", 0)
        text = f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\nvllm:num_requests_running{{model_name="m"}} 1\n'
        return web.Response(text=text, content_type="text/plain")

    async def _wait(self, request: web.Request, seconds: float | None) -> bool:
        """Sleep `seconds` (None: until the client goes); False if the client went away."""
        end = None if seconds is None else time.monotonic() + seconds
        while end is None or time.monotonic() < end:
            if request.transport is None or request.transport.is_closing():
                self.cancelled += 1
                return False
            await asyncio.sleep(0.01)
        return True

    async def complete(self, request: web.Request) -> web.StreamResponse:
        b = dict(self.behaviour)
        body = await request.json()
        self.seen.append(({k.lower(): v for k, v in request.headers.items()}, body))
        if b.get("hang") or (b.get("hang_pd") and "kv_transfer_params" in body):
            await self._wait(request, None)
            return web.Response(status=499)
        if b.get("error_event") and body.get("stream"):  # vLLM's way to fail a stream before its first token
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if b["status"] != 200:
            if not await self._wait(request, b["delay"]):
                return web.Response(status=499)
            self.completed += 1
            return web.json_response(b.get("body", {"error": {"message": f"{self.name} says no"}}), status=b["status"])
        if not body.get("stream"):
            if not await self._wait(request, b["delay"]):
                return web.Response(status=499)
            self.completed += 1
            answer: dict[str, Any] = {"choices": [{"index": 0, "text": f"{self.name} answer", "finish_reason": "length"}]}
            if b.get("prompt_tokens"):
                answer["usage"] = {"prompt_tokens": b["prompt_tokens"], "completion_tokens": body.get("max_tokens", 16)}
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if not await self._wait(request, b["delay"]):
            return resp
        for i in range(b["chunks"]):
            await resp.write(EVENT)
            if b.get("first_then_hang"):
                await self._wait(request, None)
                return resp
            if b["gap"] and not await self._wait(request, b["gap"]):
                return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.completed += 1
        return resp


class Deployment:
    """Stub P(s) and D(s), one real bootstrap server per P, and a proxy in front."""

    def __init__(self, n_prefill: int = 1, n_decode: int = 1, engines: dict[int, str] | None = None, *, guard: Any = None,
                 ssl: Any = None, **config: Any) -> None:
        self.guard, self.ssl = guard, ssl
        self.prefills = [Stub(f"p{i}") for i in range(n_prefill)]
        self.decodes = [Stub(f"d{i}") for i in range(n_decode)]
        self.engines = {0: "engine-a"} if engines is None else engines
        self.config_overrides = {"health_interval": 0.1, "health_timeout": 1.0, "unhealthy_after": 1, **config}
        self.bootstraps: list[Any] = []
        self.proxy: BackgroundProxy | None = None

    def register(self, index: int, engine_id: str, dp_rank: int = 0) -> None:
        with BootstrapClient(self.bootstraps[index].url, retries=0) as bs:
            # The side-channel address must accept TCP for the bootstrap's liveness probe:
            # P's own HTTP port does.
            port = self.prefills[index].service.port
            bs.register(RegisterRequest(engine_id=engine_id, dp_rank=dp_rank, tp_rank=0, pp_rank=0,
                                        addr=f"tcp://127.0.0.1:{port}"))

    def deregister(self, index: int, engine_id: str) -> None:
        with BootstrapClient(self.bootstraps[index].url, retries=0) as bs:
            bs.deregister(engine_id)

    def __enter__(self) -> Deployment:
        for s in (*self.prefills, *self.decodes):
            s.service.start()
        for i, _ in enumerate(self.prefills):
            self.bootstraps.append(start_background(probe=ProbePolicy(interval=0)))
            for rank, engine in self.engines.items():
                self.register(i, engine, rank)
        cfg = build_config(
            [f"{p.url},{b.url}" for p, b in zip(self.prefills, self.bootstraps)],
            [d.url for d in self.decodes],
            port=0,
            **self.config_overrides,
        )
        self.proxy = BackgroundProxy(cfg, guard=self.guard, ssl=self.ssl).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for b in self.bootstraps:
            b.stop()
        for s in (*self.prefills, *self.decodes):
            s.service.stop()

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0, trust_env=False)


class PlannerStub:
    """A proxy's planner signal and drain (GET /pdkv/planner, POST /pdkv/drain) as `pdkv up`'s autoscaler reads
    them, on a real aiohttp server: `desired` is what the test sets, every drain reports `in_flight` requests on
    the engine. `drains` holds each POSTed (url, draining)."""

    def __init__(self, prefill: int = 1, decode: int = 1) -> None:
        self.desired = {"prefill": prefill, "decode": decode}
        self.in_flight = 0
        self.drains: list[tuple[str, bool]] = []
        app = web.Application()
        app.router.add_get("/pdkv/planner", self.planner)
        app.router.add_post("/pdkv/drain", self.drain)
        self.service = BackgroundService(app)

    @property
    def url(self) -> str:
        return self.service.url

    async def planner(self, request: web.Request) -> web.Response:
        counts = RoleCounts(self.desired["prefill"], self.desired["decode"])
        return web.Response(body=msgspec.json.encode(PlannerView(desired=counts, current=counts)), content_type="application/json")

    async def drain(self, request: web.Request) -> web.Response:
        ask = msgspec.json.decode(await request.read(), type=DrainRequest)
        self.drains.append((ask.url, ask.draining))
        answer = DrainAnswer(ask.url, "prefill", ask.draining, self.in_flight)
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

    def __enter__(self) -> PlannerStub:
        self.service.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.service.__exit__(*exc)

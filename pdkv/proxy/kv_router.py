"""The kv-aware policy on the request path: a request's token ids and block keys, the plan, the predictions.

Token ids come from an engine's own `/tokenize` (the chat template applied
exactly as the engine applies it: the same code, the same tokenizer); the
block keys are chained over them (pdkv.proxy.kv.prefix) in the key space the
event subscriber builds from BlockStored's token ids. The plan is
pdkv.proxy.kv.policy's. Once routed, the request's blocks are predicted on
the chosen engines until their events confirm them.

Each engine's own /metrics is read every `metrics_interval_s`
(pdkv.proxy.kv.load): D's KV usage and its running and waiting
requests (from every client, not only this proxy's) enter D's cost, and
the prefix-cache hits each engine itself counts are exported beside the
hits the proxy predicted, so a drift between the two shows.

A start-up self-check per engine sends one fresh prompt straight to it and
waits (bounded) for the engine's events to report exactly the keys the proxy
computes for that prompt: a mismatch is a loud warning and
`pdkv_proxy_kv_self_check{engine} 0`, never silent zero hits.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from pdkv.errors import ConfigError
from pdkv.protocol import ProxyTiming
from pdkv.proxy.config import Policy, ProxyConfig, parse_decode
from pdkv.proxy.http import UpstreamError, UpstreamPool, fetch
from pdkv.proxy.kv import (
    BlockKey,
    DecodeCandidate,
    EngineLoad,
    EventSource,
    KvConfig,
    KvEventSubscriber,
    KvIndex,
    KvMetrics,
    LocalTokenizer,
    PrefillCandidate,
    RoutePlan,
    block_keys,
    completion_prompt,
    counter_delta,
    parse_engine_metrics,
    plan_route,
)
from pdkv.proxy.routing import Pairing

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pdkv.proxy.backends import Backends, BackendState, PrefillState

log = logging.getLogger("pdkv.proxy.kv")
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
# Chat fields vLLM's /tokenize reads to render the prompt as /v1/chat/completions would.
_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                "chat_template_kwargs", "tools", "documents")
SELF_CHECK_TIMEOUT_S = 30.0
SELF_CHECK_EVENTS_S = 10.0  # from the self-check's answer to its blocks' events
SELF_CHECK_TEXT = ("the prefill engine computes the prompt and the decode engine holds the cache for the next turn of the chat "
                   "while the proxy routes every request to the block that is already there ") * 3


def parse_event_source(spec: str) -> EventSource:
    """`ENGINE_URL=tcp://HOST:PORT[,tcp://HOST:REPLAY]` (the replay defaults to PORT + 1)."""
    url, sep, rest = spec.partition("=")
    pub, _, replay = rest.partition(",")
    pub, replay = pub.strip(), replay.strip()
    if not sep or not pub.startswith("tcp://") or ":" not in pub[6:]:
        raise ConfigError(f"KV events source {spec!r} is not ENGINE_URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]",
                          hint="e.g. --kv-events http://127.0.0.1:8100=tcp://127.0.0.1:5557")
    if not replay:
        head, _, port = pub.rpartition(":")
        if not port.isdigit():
            raise ConfigError(f"KV events endpoint {pub!r} has no port number")
        replay = f"{head}:{int(port) + 1}"
    return EventSource(parse_decode(url), pub, replay if replay != "none" else None)


class KvChoice(msgspec.Struct):
    plan: RoutePlan
    keys: list[BlockKey]
    prefill: int | None  # index into Backends.routable()'s targets
    decode: BackendState
    tokenize_s: float = 0.0


class KvRouter:
    """Owns the index, the event subscriber and the policy's bookkeeping; lives on the proxy's loop."""

    def __init__(self, config: KvConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.weights = config.weights()
        self.sources = [parse_event_source(s) for s in config.events]
        self.index = KvIndex(predict_ttl_s=config.predict_ttl_s, approximate_ttl_s=config.approximate_ttl_s)
        self.metrics = KvMetrics(registry)
        self.subscriber = KvEventSubscriber(self.index, self.sources, observer=self.metrics, silent_after_s=config.silent_after_s)
        self._inflight: dict[str, dict[str, tuple[ProxyTiming, int]]] = {}  # P url -> request id -> (timing, tokens to compute)
        self._cursor = 0
        self._checks: list[asyncio.Task] = []
        self.loads: dict[str, tuple[EngineLoad, float]] = {}  # engine -> its last /metrics reading, when (monotonic)
        self.self_checks: dict[str, str] = {}  # engine -> ok | mismatch | no_events | failed: ...
        self.local: LocalTokenizer | None = LocalTokenizer(config.tokenizer) if config.tokenizer else None

    @classmethod
    def for_config(cls, config: ProxyConfig, registry: CollectorRegistry) -> KvRouter | None:
        """The router for a proxy whose policy is kv-aware, else None."""
        return cls(config.kv, registry) if config.policy is Policy.KV_AWARE else None

    def start(self, backends: Backends) -> None:
        self.subscriber.start()
        if self.config.metrics_interval_s > 0:
            self._checks.append(asyncio.get_running_loop().create_task(self._scrape_loop(backends)))
        for src in self.sources:
            self.metrics.self_check.labels(src.engine).set(-1)
            if self.config.self_check:
                self._checks.append(asyncio.get_running_loop().create_task(self._self_check(src.engine, backends)))

    def follow(self, engine_url: str, kv_events: str | None, kv_events_replay: str | None) -> None:
        """Follow (or, with `kv_events` None, stop following) an engine learnt at run time, e.g. a members-registry
        record's `url`, `kv_events` and `kv_events_replay`."""
        url = parse_decode(engine_url)
        if kv_events is None:
            self.subscriber.unfollow(url)
            return
        self.subscriber.follow(EventSource(url, kv_events, kv_events_replay))

    async def close(self) -> None:
        for task in self._checks:
            task.cancel()
        await asyncio.gather(*self._checks, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self.subscriber.close)

    # --- tokens
    async def token_ids(self, body: dict[str, Any], endpoint: str, pool: UpstreamPool) -> list[int] | None:
        """The prompt's token ids as the engine will see them (the proxy's own tokenizer when it has one and it can
        render this request, else the engine's /tokenize), or None (a batch of prompts, or /tokenize failed)."""
        if self.local is not None:
            ids = self.local.token_ids(body, endpoint)
            if ids is not None:
                return ids
        return await self.engine_token_ids(body, endpoint, pool)

    async def engine_token_ids(self, body: dict[str, Any], endpoint: str, pool: UpstreamPool) -> list[int] | None:
        """The prompt's token ids from the engine's own /tokenize."""
        if endpoint.endswith("/chat/completions"):
            if not isinstance(body.get("messages"), list):
                return None
            req = {k: body[k] for k in _CHAT_FIELDS if k in body}
        else:
            prompt = completion_prompt(body)
            if not isinstance(prompt, str):
                return prompt
            req = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
        if "model" in body:
            req["model"] = body["model"]
        try:
            ex = await fetch(pool, "POST", "/tokenize", body=_json_encode(req), timeout=self.config.tokenize_timeout_s)
            if ex.status != 200:
                log.debug("/tokenize answered %d: %s", ex.status, b"".join(ex.chunks)[:200])
                return None
            tokens = _json_decode(b"".join(ex.chunks)).get("tokens")
        except (UpstreamError, msgspec.DecodeError, AttributeError) as exc:
            log.debug("/tokenize failed: %s", exc)
            return None
        return tokens if isinstance(tokens, list) else None

    def block_size(self) -> int | None:
        if self.config.block_size:
            return self.config.block_size
        for src in self.sources:
            size = self.index.block_size(src.engine)
            if size:
                return size
        return None

    # --- the plan
    async def choose(self, body: dict[str, Any], endpoint: str, backends: Backends, t: ProxyTiming) -> KvChoice | None:
        """Where this request goes, or None when no P/D pair is up (the proxy's no-prefill path then decides).
        A plan for D alone (`prefill` None) is recorded as routed at once; a P/D plan once paired (`pairing`)."""
        targets, _owners, decodes = backends.routable()
        if not decodes or not targets:
            return None
        started = time.perf_counter()
        tokens = await self.token_ids(body, endpoint, decodes[0].pool)
        tokenize_s = time.perf_counter() - started
        self.metrics.tokenize.observe(tokenize_s)
        targets, _owners, decodes = backends.routable()  # it may have changed while we waited
        if not decodes or not targets:
            return None
        size = self.block_size()
        keyed = tokens is not None and size is not None
        keys = block_keys(tokens, size) if keyed else []  # type: ignore[arg-type]
        now = time.monotonic()
        p_cands = [PrefillCandidate(self.index.hits(t.url, keys, now).blocks if keyed else 0, self.queued_tokens(t.url),
                                    backends.in_flight(t)) for t in targets]
        d_cands = [self._decode_candidate(d, keys if keyed else [], now) for d in decodes]
        self._cursor += 1
        plan = plan_route(len(tokens) if tokens else 0, size or 1, p_cands, d_cands, self.weights, start=self._cursor, keyed=keyed)
        self.metrics.route.labels(str(plan.reason)).inc()
        choice = KvChoice(plan, keys, plan.prefill, decodes[plan.decode], tokenize_s)
        if plan.prefill is None:
            self.routed(choice, t, None)
        return choice

    def _decode_candidate(self, d: BackendState, keys: list[BlockKey], now: float) -> DecodeCandidate:
        """D as the cost model sees it: its hits, its requests (this proxy's in flight, or all the engine reports if more),
        its KV usage (from a recent /metrics reading, else 0)."""
        hits = self.index.hits(d.url, keys, now).blocks if keys else 0
        load = self.load(d.url, now)
        if load is None:
            return DecodeCandidate(hits, d.outstanding)
        return DecodeCandidate(hits, max(d.outstanding, load.requests), load.kv_usage)

    def load(self, engine: str, now: float) -> EngineLoad | None:
        """The engine's last /metrics reading, if it is at most three intervals old."""
        seen = self.loads.get(engine)
        if seen is None or now - seen[1] > 3 * self.config.metrics_interval_s:
            return None
        return seen[0]

    async def _scrape_loop(self, backends: Backends) -> None:
        interval = self.config.metrics_interval_s
        while True:
            engines = [b for b in (*backends.prefills, *backends.decodes) if b.up]
            await asyncio.gather(*(self._scrape(b, min(interval, 2.0)) for b in engines))
            await asyncio.sleep(interval)

    async def _scrape(self, b: BackendState, timeout: float) -> None:
        try:
            ex = await fetch(b.pool, "GET", "/metrics", timeout=timeout)
            load = parse_engine_metrics(b"".join(ex.chunks)) if ex.status == 200 else None
        except UpstreamError as exc:
            log.debug("kv-aware: /metrics of %s: %s", b.url, exc)
            load = None
        if load is None:
            self.metrics.engine_scrape_errors.labels(b.url).inc()
            return
        before = self.loads.get(b.url)
        self.loads[b.url] = (load, time.monotonic())
        self.metrics.engine_kv_usage.labels(b.url).set(load.kv_usage)
        hits, queries = (before[0].prefix_hits, before[0].prefix_queries) if before else (None, None)
        self.metrics.engine_hit_tokens.labels(b.url).inc(counter_delta(hits, load.prefix_hits))
        self.metrics.engine_query_tokens.labels(b.url).inc(counter_delta(queries, load.prefix_queries))

    def pairing(self, choice: KvChoice | None, backends: Backends, t: ProxyTiming) -> tuple[Pairing, PrefillState, BackendState] | None:
        """The P/D pair of `choice` (recorded as routed), or None if there is none."""
        targets, owners, _ = backends.routable()
        if choice is None or choice.prefill is None or choice.prefill >= len(targets):
            return None
        if not backends.may_pair(choice.prefill, choice.decode):  # model, block size, TP or transport disagree
            return backends.pair()
        target = targets[choice.prefill]
        self.routed(choice, t, target.url)
        return Pairing(target, choice.decode.url), owners[choice.prefill], choice.decode

    def routed(self, choice: KvChoice, t: ProxyTiming, p_url: str | None) -> None:
        """The request is being sent: count its hits, predict its blocks where they will be, queue P's work."""
        plan, keys, now = choice.plan, choice.keys, time.monotonic()
        d_url = choice.decode.url
        if keys:
            self.metrics.prompt_tokens.inc(plan.prompt_tokens)
            self._count_hits(d_url if p_url is None else p_url, keys, now)
            if p_url is not None:
                self.index.predict(p_url, keys, now)
            self.index.predict(d_url, keys, now)  # D computes them, or pulls them into its own cache
        if p_url is not None:
            self._inflight.setdefault(p_url, {})[t.request_id] = (t, plan.prompt_tokens - plan.p_hit_tokens)
        t.route = plan.summary() + (f"; tokenized in {choice.tokenize_s * 1000:.1f} ms" if choice.tokenize_s else "")

    def _count_hits(self, engine: str, keys: list[BlockKey], now: float) -> None:
        size = self.block_size() or 0
        hits = self.index.hits(engine, keys, now)
        if hits.reported:
            self.metrics.hit_tokens.labels(engine, "reported").inc(hits.reported * size)
        if hits.predicted:
            self.metrics.hit_tokens.labels(engine, "predicted").inc(hits.predicted * size)

    def finished(self, t: ProxyTiming) -> None:
        """The request is over: its prefill work leaves P's queue."""
        self._inflight.get(t.prefill_url, {}).pop(t.request_id, None)

    def queued_tokens(self, p_url: str) -> int:
        """Prefill tokens this proxy sent `p_url` whose KV has not reached D yet (D's first byte): P's work for a
        request is its prefill and then sending the KV, which P's connector does after P has answered."""
        return sum(n for t, n in self._inflight.get(p_url, {}).values() if t.decode_first_byte is None and t.error is None)

    # --- the self-check
    async def _self_check(self, engine: str, backends: Backends) -> None:
        state = next((b for b in (*backends.prefills, *backends.decodes) if b.url == engine), None)
        if state is None:
            self._check_result(engine, "failed: the proxy does not route to this engine", 0)
            return
        while not state.up:
            await asyncio.sleep(0.5)
        try:
            ok = await asyncio.wait_for(self._check_once(engine, state), SELF_CHECK_TIMEOUT_S)
        except (asyncio.TimeoutError, UpstreamError, msgspec.DecodeError, KeyError, TypeError) as exc:
            self._check_result(engine, f"failed: {exc or type(exc).__name__}", -1)
            return
        self._check_result(engine, *ok)

    async def _check_once(self, engine: str, state: BackendState) -> tuple[str, int]:
        timeout = self.config.tokenize_timeout_s
        models = await fetch(state.pool, "GET", "/v1/models", timeout=timeout)
        model = _json_decode(b"".join(models.chunks))["data"][0]["id"]
        # The nonce leads, so every block of the prompt is new to the engine and reported now.
        body = {"model": model, "prompt": f"{uuid.uuid4().hex} {SELF_CHECK_TEXT}", "max_tokens": 1}
        tokens = await self.engine_token_ids(body, "/v1/completions", state.pool)
        if tokens is None:
            return "failed: the engine's /tokenize did not answer", -1
        await self._check_tokenizer(body, model, state.pool)
        ex = await fetch(state.pool, "POST", "/v1/completions", body=_json_encode(body), timeout=SELF_CHECK_TIMEOUT_S)
        if ex.status != 200:
            return f"failed: the self-check prompt was answered {ex.status}", -1
        deadline = time.monotonic() + SELF_CHECK_EVENTS_S
        while time.monotonic() < deadline:
            size = self.config.block_size or self.index.block_size(engine)
            if size:
                keys = block_keys(tokens, size)
                if keys and self.index.hits(engine, keys, time.monotonic()).reported == len(keys):
                    return "ok", 1
            await asyncio.sleep(0.1)
        if self.index.block_size(engine) is None:
            return f"no_events: none came from the engine within {SELF_CHECK_EVENTS_S:.0f} s", -1
        return "mismatch: the engine stored the prompt's blocks under other keys (another tokenizer, block size or salt?)", 0

    async def _check_tokenizer(self, body: dict[str, Any], model: str, pool: UpstreamPool) -> None:
        """The proxy's own tokenizer must give the engine's token ids for a prompt and a chat, or it is not used."""
        local = self.local
        if local is None:
            return
        chat = {"model": model, "messages": [{"role": "system", "content": SELF_CHECK_TEXT[:200]},
                                             {"role": "user", "content": body["prompt"][:120]}]}
        for endpoint, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            mine, theirs = local.token_ids(request, endpoint), await self.engine_token_ids(request, endpoint, pool)
            if theirs is not None and mine != theirs:
                log.warning("kv-aware: the proxy's tokenizer (%s) differs from the engine's for %s; asking the engine's "
                            "/tokenize instead", local.folder, endpoint)
                self.metrics.tokenizer_match.set(0)
                self.local = None
                return
        self.metrics.tokenizer_match.set(1)

    def _check_result(self, engine: str, result: str, value: int) -> None:
        self.self_checks[engine] = result
        self.metrics.self_check.labels(engine).set(value)
        if value == 1:
            log.info("kv-aware: engine %s's KV events match the proxy's block keys", engine)
        else:
            log.warning("kv-aware: SELF-CHECK %s for engine %s: its prefix hits cannot be trusted "
                        "(check that it runs with --kv-events-config and the same block size)", result.upper(), engine)

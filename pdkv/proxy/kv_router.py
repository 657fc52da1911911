"""The kv-aware policy behind the proxy's routing seam (pdkv.proxy.router): a request's block keys, the placement,
the predictions.

Token ids come from the proxy's own tokenizer or an engine's `/tokenize` (pdkv.proxy.engine_tokens); the
block keys are chained over them (pdkv.proxy.kv.prefix) in the key space the event subscriber builds from
BlockStored's token ids. The placement is pdkv.proxy.kv.policy's. Once routed, the request's blocks are predicted on
the chosen engines until their events confirm them.

Each engine's own /metrics (pdkv.proxy.engine_loads, read every `metrics_interval_s`): D's KV usage and its
running and waiting requests (from every client, not only this proxy's) enter D's cost, and the prefix-cache
hits each engine itself counts are exported beside the hits the proxy predicted, so a drift between the two
shows. Each followed engine is self-checked at start (pdkv.proxy.kv_self_check).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from pdkv.engine_api import EngineLoad
from pdkv.errors import ConfigError
from pdkv.proxy_api import ProxyTiming
from pdkv.proxy.backends import Backends, BackendState, PrefillState
from pdkv.proxy.config import parse_decode
from pdkv.proxy.engine_loads import EngineLoads
from pdkv.proxy.engine_tokens import PromptTokens
from pdkv.proxy.kv import (
    BlockKey,
    DecodeCandidate,
    EventSource,
    KvConfig,
    KvEventSubscriber,
    KvIndex,
    KvMetrics,
    LocalTokenizer,
    PrefillCandidate,
    Placement,
    block_keys,
    counter_delta,
    place_request,
)
from pdkv.proxy.kv_self_check import SelfChecks
from pdkv.proxy.router import Route
from pdkv.proxy.routing import Pairing

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("pdkv.proxy.kv")


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
    placement: Placement
    keys: list[BlockKey]
    prefill: int | None  # index into Backends.routable()'s targets
    decode: BackendState
    tokenize_s: float = 0.0


class KvRouter:
    """The kv-aware Router: owns the index, the event subscriber and the policy's bookkeeping; lives on the
    proxy's loop. Reads the engines' loads from `loads` (its loop runs while this router does)."""

    def __init__(self, config: KvConfig, registry: CollectorRegistry, backends: Backends, loads: EngineLoads) -> None:
        self.config = config
        self.backends = backends
        self.weights = config.weights()
        self.sources = [parse_event_source(s) for s in config.events]
        self.index = KvIndex(predict_ttl_s=config.predict_ttl_s, approximate_ttl_s=config.approximate_ttl_s)
        self.metrics = KvMetrics(registry)
        self.subscriber = KvEventSubscriber(self.index, self.sources, observer=self.metrics, silent_after_s=config.silent_after_s)
        self._inflight: dict[str, dict[str, tuple[ProxyTiming, int]]] = {}  # P url -> request id -> (timing, tokens to compute)
        self._cursor = 0
        self._tasks: list[asyncio.Task] = []
        self.loads = loads
        loads.observers.append(self._observe_load)
        loads.on_error.append(lambda url: self.metrics.engine_scrape_errors.labels(url).inc())
        self.tokens = PromptTokens(LocalTokenizer(config.tokenizer) if config.tokenizer else None, config.tokenize_timeout_s,
                                   lambda match: self.metrics.tokenizer_match.set(1 if match else 0))
        self.checks = SelfChecks(config, self.index, self.metrics, self.tokens)

    @property
    def self_checks(self) -> dict[str, str]:
        """Engine -> ok | mismatch | no_events | failed: ... (absent until its check ends)."""
        return self.checks.results

    def start(self) -> None:
        self.subscriber.start()
        loop = asyncio.get_running_loop()
        if self.config.metrics_interval_s > 0:
            self._tasks.append(loop.create_task(self.loads.run(self.config.metrics_interval_s)))
        for src in self.sources:
            self.metrics.self_check.labels(src.engine).set(-1)
            if self.config.self_check:
                self._tasks.append(loop.create_task(self.checks.check(src.engine, self.backends)))

    def health(self) -> dict[str, Any]:
        return {"kv_self_checks": self.self_checks}

    def follow(self, engine_url: str, kv_events: str | None, kv_events_replay: str | None) -> None:
        """Follow (or, with `kv_events` None, stop following) an engine learnt at run time, e.g. a members-registry
        record's `url`, `kv_events` and `kv_events_replay`."""
        url = parse_decode(engine_url)
        if kv_events is None:
            self.subscriber.unfollow(url)
            return
        self.subscriber.follow(EventSource(url, kv_events, kv_events_replay))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self.subscriber.close)

    def block_size(self) -> int | None:
        if self.config.block_size:
            return self.config.block_size
        for src in self.sources:
            size = self.index.block_size(src.engine)
            if size:
                return size
        return None

    # --- the placement
    async def route(self, body: dict[str, Any], endpoint: str, t: ProxyTiming) -> Route | None:
        """Where this request goes (recorded as routed), or None when no P/D pair is up (the proxy's no-prefill
        path then decides)."""
        choice = await self._choose(body, endpoint, t)
        if choice is None:
            return None
        if choice.prefill is None:  # D holds all but a few of the prompt's tokens: D alone
            return Route(None, None, choice.decode, "kv_local")
        chosen = self._pairing(choice, t)
        return None if chosen is None else Route(*chosen)

    async def _choose(self, body: dict[str, Any], endpoint: str, t: ProxyTiming) -> KvChoice | None:
        """The placement for this request, or None when no P/D pair is up. A placement for D alone (`prefill` None) is
        recorded as routed at once; a P/D placement once paired (`_pairing`)."""
        targets, _owners, decodes = self.backends.routable()
        if not decodes or not targets:
            return None
        started = time.perf_counter()
        tokens = await self.tokens.token_ids(body, endpoint, decodes[0].pool)
        tokenize_s = time.perf_counter() - started
        self.metrics.tokenize.observe(tokenize_s)
        targets, _owners, decodes = self.backends.routable()  # it may have changed while we waited
        if not decodes or not targets:
            return None
        size = self.block_size()
        keyed = tokens is not None and size is not None
        keys = block_keys(tokens, size) if keyed else []  # type: ignore[arg-type]
        now = time.monotonic()
        p_cands = [PrefillCandidate(self.index.hits(t.url, keys, now).blocks if keyed else 0, self.queued_tokens(t.url),
                                    self.backends.in_flight(t)) for t in targets]
        d_cands = [self._decode_candidate(d, keys if keyed else [], now) for d in decodes]
        self._cursor += 1
        placement = place_request(len(tokens) if tokens else 0, size or 1, p_cands, d_cands, self.weights, start=self._cursor, keyed=keyed)
        self.metrics.route.labels(str(placement.reason)).inc()
        choice = KvChoice(placement, keys, placement.prefill, decodes[placement.decode], tokenize_s)
        if placement.prefill is None:
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
        return self.loads.reading(engine, now, 3 * self.config.metrics_interval_s)

    def _observe_load(self, url: str, before: EngineLoad | None, load: EngineLoad) -> None:
        self.metrics.engine_kv_usage.labels(url).set(load.kv_usage)
        hits, queries = (before.prefix_hits, before.prefix_queries) if before else (None, None)
        self.metrics.engine_hit_tokens.labels(url).inc(counter_delta(hits, load.prefix_hits))
        self.metrics.engine_query_tokens.labels(url).inc(counter_delta(queries, load.prefix_queries))

    def _pairing(self, choice: KvChoice | None, t: ProxyTiming) -> tuple[Pairing, PrefillState, BackendState] | None:
        """The P/D pair of `choice` (recorded as routed), or None if there is none."""
        targets, owners, _ = self.backends.routable()
        if choice is None or choice.prefill is None or choice.prefill >= len(targets):
            return None
        if not self.backends.may_pair(choice.prefill, choice.decode):  # model, block size, TP or transport disagree
            return self.backends.pair()
        target = targets[choice.prefill]
        self.routed(choice, t, target.url)
        return Pairing(target, choice.decode.url), owners[choice.prefill], choice.decode

    def routed(self, choice: KvChoice, t: ProxyTiming, p_url: str | None) -> None:
        """The request is being sent: count its hits, predict its blocks where they will be, queue P's work."""
        placement, keys, now = choice.placement, choice.keys, time.monotonic()
        d_url = choice.decode.url
        if keys:
            self.metrics.prompt_tokens.inc(placement.prompt_tokens)
            self._count_hits(d_url if p_url is None else p_url, keys, now)
            if p_url is not None:
                self.index.predict(p_url, keys, now)
            self.index.predict(d_url, keys, now)  # D computes them, or pulls them into its own cache
        if p_url is not None:
            self._inflight.setdefault(p_url, {})[t.request_id] = (t, placement.prompt_tokens - placement.p_hit_tokens)
        t.route = placement.summary() + (f"; tokenized in {choice.tokenize_s * 1000:.1f} ms" if choice.tokenize_s else "")

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

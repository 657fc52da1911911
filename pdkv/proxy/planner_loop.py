"""The planner's live signal in the proxy: what it observes, every `interval_s` turned into desired counts.

Each finished P/D request leaves a `RequestSample` (its prompt length from
P's usage, its output length from D's usage or, streamed, D's events, its
TTFT and ITL). Every `interval_s` the loop reads P's queue from each live
prefill server's /metrics (vllm:num_requests_waiting, and running for the
view; pdkv.proxy.engine_loads, whose reading of the last second it takes when
the kv-aware policy's loop made one), counts the engines serving now (a draining one no longer counts),
builds an `Observation` over the last `window_s` (pdkv.planner.window), calls
`DesiredCounts.update` and publishes `PlannerGauges` on the proxy's /metrics.
`view()` is GET /pdkv/planner's JSON: what `pdkv up`'s autoscaler reads.

TTFT of a request that is not streamed: D's first byte is its whole answer,
so its P answer (queue and prefill, the part P's count changes) stands in.
All the state here is owned by the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

import msgspec
from prometheus_client import CollectorRegistry

from pdkv.planner import DesiredCounts, PlannerGauges, RequestSample, ScalePolicy, Slo, load_profile, observe_window
from pdkv.proxy_api import LatencyMs, PlannerObservation, PlannerView, ProxyTiming, RoleBounds, RoleCounts, TargetsMs
from pdkv.proxy.backends import Backends
from pdkv.proxy.config import PlannerConfig
from pdkv.proxy.engine_loads import EngineLoads

log = logging.getLogger("pdkv.proxy")

_decode = msgspec.json.Decoder().decode
MAX_SAMPLES = 100_000  # a bound on memory at any rate; a window holds at most this many requests
FRESH_S = 1.0  # a prefill server's reading younger than this (or than the round's interval) is P's queue now


def usage_tokens(body: bytes, field: str) -> int:
    """`usage[field]` of an OpenAI JSON answer, 0 when it has none."""
    try:
        usage = _decode(body).get("usage") or {}
    except (msgspec.DecodeError, AttributeError):
        return 0
    value = usage.get(field) if isinstance(usage, dict) else None
    return value if isinstance(value, int) else 0


def request_sample(t: ProxyTiming, prefill_body: bytes, decode_body: bytes, events: int, clock_offset: float) -> RequestSample | None:
    """The sample of one request that P and D answered (None for a failed one). `events`: SSE events D streamed
    (its output tokens, less the closing [DONE]); `clock_offset` turns unix times into the loop's clock."""
    if t.error is not None or t.status is None or not 200 <= t.status < 300:
        return None
    prompt = usage_tokens(prefill_body, "prompt_tokens")
    if t.stream:
        output = max(0, events - 1)
        first = t.decode_first_byte
    else:
        output = usage_tokens(decode_body, "completion_tokens")
        first = t.prefill_responded
    ttft = None if first is None else max(0.0, first - t.received)  # None: D answered alone (no P in this request)
    itl = None
    if t.stream and output > 1 and t.last_byte is not None and t.decode_first_byte is not None:
        itl = max(0.0, t.last_byte - t.decode_first_byte) / (output - 1)
    return RequestSample(at_s=t.received + clock_offset, prompt_tokens=prompt, output_tokens=output, ttft_s=ttft, itl_s=itl)


class PlannerLoop:
    """The signal's state and loop; `record` from the request path, `run()` until cancelled, `view()` for /pdkv/planner."""

    def __init__(self, config: PlannerConfig, backends: Backends, loads: EngineLoads, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """ConfigError when the profile does not load."""
        self.config = config
        self.backends = backends
        self.loads = loads
        self.clock = clock
        self.profile = load_profile(config.profile)
        self.slo = Slo(config.ttft_ms, config.itl_ms, config.quantile)
        self.policy = ScalePolicy(min_prefill=config.min_prefill, max_prefill=config.max_prefill, min_decode=config.min_decode,
                                  max_decode=config.max_decode, down_margin=config.down_margin, down_after_s=config.down_after_s,
                                  up_after_s=config.up_after_s)  # fmt: skip
        self.counts = DesiredCounts(self.profile, self.slo, self.policy)
        self.gauges = PlannerGauges(registry)
        self.samples: collections.deque[RequestSample] = collections.deque(maxlen=MAX_SAMPLES)
        self.started = clock()
        self.rounds = 0
        self._view = PlannerView()

    def record(self, t: ProxyTiming, prefill_body: bytes, decode_body: bytes, events: int) -> None:
        sample = request_sample(t, prefill_body, decode_body, events, self.clock() - time.time())
        if sample is not None:
            self.samples.append(sample)

    def current(self) -> tuple[int, int]:
        """(prefill engines, decode servers) routable now: a draining or unhealthy one does not count."""
        targets, _, decodes = self.backends.routable()
        return len(targets), len(decodes)

    async def prefill_queue(self) -> tuple[float, float]:
        """(waiting, running) summed over the live prefill servers' /metrics; one that does not answer adds nothing."""
        _, owners, _ = self.backends.routable()
        servers = list({id(p): p for p in owners}.values())
        readings = await self.loads.fresh(servers, min(FRESH_S, self.config.interval_s))
        return float(sum(r.waiting for r in readings if r)), float(sum(r.running for r in readings if r))

    def step(self, waiting: float, running: float = 0.0) -> PlannerView:
        """One round: observe, update the desired counts, publish the gauges; returns (and keeps) the view."""
        now = self.clock()
        p, d = self.current()
        obs = observe_window(self.samples, now_s=now, window_s=self.config.window_s, quantile_q=self.config.quantile,
                             prefill_engines=p, decode_engines=d, prefill_waiting=waiting, since_s=self.started)  # fmt: skip
        desired = self.counts.update(obs)
        self.gauges.publish(desired, p, d)
        self.rounds += 1
        prompts, outputs = obs.prompt_tokens, obs.output_tokens
        self._view = PlannerView(
            desired=RoleCounts(desired.prefill, desired.decode),
            current=RoleCounts(p, d),
            need=RoleCounts(desired.need_prefill, desired.need_decode),
            keep=RoleCounts(desired.keep_prefill, desired.keep_decode),
            binding=desired.binding,
            predicted_ms=LatencyMs(_finite(desired.predicted_ttft_ms), _finite(desired.predicted_itl_ms)),
            targets_ms=TargetsMs(self.slo.ttft_ms, self.slo.itl_ms, self.slo.quantile),
            observation=PlannerObservation(
                window_s=self.config.window_s, rate=round(obs.rate, 4), requests=len(prompts),
                mean_prompt_tokens=round(sum(prompts) / len(prompts), 1) if prompts else None,
                mean_output_tokens=round(sum(outputs) / len(outputs), 1) if outputs else None,
                prefill_waiting=waiting, prefill_running=running, ttft_ms=obs.ttft_ms, itl_ms=obs.itl_ms,
            ),
            bounds=RoleBounds([self.policy.min_prefill, self.policy.max_prefill], [self.policy.min_decode, self.policy.max_decode]),
            rounds=self.rounds,
            at=time.time(),
        )
        return self._view

    def view(self) -> PlannerView:
        """GET /pdkv/planner: the last round's view (desired None before the first round)."""
        return msgspec.structs.replace(self._view, backends=self.backends.drain_report())

    async def run(self) -> None:
        """A round every `interval_s` until cancelled; a round that fails is logged and the next one tries again."""
        while True:
            try:
                waiting, running = await self.prefill_queue()
                self.step(waiting, running)
            except Exception:  # noqa: BLE001 - the signal must outlive one bad round
                log.exception("planner round failed")
            await asyncio.sleep(self.config.interval_s)


def _finite(ms: float) -> float | None:
    return round(ms, 3) if ms == ms and ms not in (float("inf"), float("-inf")) else None

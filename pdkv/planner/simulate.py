"""A discrete-event simulation of a P/D fleet, its engines timed by a profile's fitted curves (pure; seeded).

Requests arrive as a Poisson stream whose rate follows `rate_at(t)` (by
thinning), with prompt and output lengths drawn from the workload's samples.
The router sends each to the next serving P and then the next serving D in
turn (round-robin, the proxy's default policy).

- P serves its queue in order, one forward at a time: the forward takes every
  waiting prompt up to `max_batch_tokens` and lasts the profile's prefill step
  for them (overhead + per request + per token + per token squared).
- After `handover_ms` and its time outside P's engine (the prefill fit's
  `outside_ms`: HTTP and API server, a delay that holds no engine) the request joins a D. D decodes every sequence it
  holds together, one token each per step, a step lasting the profile's ITL
  for its batch and KV. A sequence's first token comes one step after it
  joins (TTFT ends there); it leaves after its last. A D admits a sequence
  only while its KV (prompt + output, reserved at admission) fits, else the
  sequence waits.
- D's steps are not simulated one by one: between two changes of its batch
  a D's step time is constant, so sequences progress as a fluid, counted in
  steps ("progress"), and the next event is the nearest finish.

With a `DesiredCounts` signal, every `interval_s` it sees the last
`window_s` (rate, lengths, P's queue, TTFT and ITL at the targets' quantile)
and the serving counts; engines it asks for serve after `startup_s`, and
ones it lets go stop taking requests and stop once empty (drain).
Engine-seconds count every engine from its start to its stop, starting and
draining included.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from typing import Literal

import msgspec

from pdkv.planner.profile import Profile
from pdkv.planner.signal import DesiredCounts, Observation
from pdkv.planner.workload import Slo, Workload

Role = Literal["prefill", "decode"]
WINDOW_LENGTHS = 64  # lengths handed to the signal per window: a stride through the window's requests
MIN_STEP_MS = 1e-3  # a decode step is never free: with a zero step, progress would never advance
FINISH_SLACK = 1e-6  # steps: a sequence this close to its end has ended (float time cannot land closer)


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    duration_s: float
    startup_s: float = 60.0  # an engine asked for serves this long later
    interval_s: float = 10.0  # the signal's period
    window_s: float = 30.0  # what it looks back on
    max_batch_tokens: int = 8192  # P's tokens per forward (vLLM's max_num_batched_tokens)
    seed: int = 0


class TimelinePoint(msgspec.Struct, frozen=True):
    t: float
    rate: float
    prefill: int  # serving
    decode: int
    desired_prefill: int
    desired_decode: int


class SimResult(msgspec.Struct, frozen=True):
    requests: int
    attainment: float  # share of requests meeting both targets (TTFT, and their own mean ITL)
    ttft_attainment: float
    itl_attainment: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p90_ms: float
    engine_hours: float
    prefill_engine_hours: float
    decode_engine_hours: float
    peak_prefill: int
    peak_decode: int
    timeline: list[TimelinePoint]


class _Engine:
    __slots__ = ("role", "index", "started", "ready_at", "stopped", "draining", "queue", "busy", "progress", "last_t", "step_ms",
                 "finish", "count", "prompt_sum", "join_sum", "kv_reserved", "waiting", "version")  # fmt: skip

    def __init__(self, role: Role, index: int, started: float, ready_at: float) -> None:
        self.role, self.index, self.started, self.ready_at = role, index, started, ready_at
        self.stopped: float | None = None
        self.draining = False
        self.queue: deque[int] = deque()  # P: requests waiting
        self.busy = False  # P: a forward is running
        self.progress = 0.0  # D: steps taken, as a fluid
        self.last_t = started
        self.step_ms = 0.0
        self.finish: list[tuple[float, int]] = []  # D: (progress at which it ends, request)
        self.count = 0
        self.prompt_sum = 0.0
        self.join_sum = 0.0
        self.kv_reserved = 0.0
        self.waiting: deque[int] = deque()  # D: requests whose KV does not fit yet
        self.version = 0

    def empty(self) -> bool:
        return not self.queue and not self.busy and self.count == 0 and not self.waiting


class Simulation:
    """One run. `signal` None: the counts given stay all day (a static xPyD), serving from t = 0."""

    def __init__(self, profile: Profile, workload: Workload, slo: Slo, rate_at: Callable[[float], float], peak_rate: float,
                 config: SimConfig, prefill: int, decode: int, signal: DesiredCounts | None = None) -> None:  # fmt: skip
        self.profile, self.workload, self.slo, self.rate_at, self.peak = profile, workload, slo, rate_at, peak_rate
        self.config, self.signal = config, signal
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.engines: dict[Role, list[_Engine]] = {"prefill": [], "decode": []}
        self.rr = {"prefill": 0, "decode": 0}
        self.arrival: list[float] = []
        self.prompt: list[int] = []
        self.output: list[int] = []
        self.first: list[float] = []
        self.done: list[float] = []
        self.timeline: list[TimelinePoint] = []
        self.prefill_forwards = self.prefilled = 0  # P's forwards, and the prompts they answered
        self.desired = {"prefill": prefill, "decode": decode}
        self.serving: dict[Role, list[_Engine]] = {"prefill": [], "decode": []}  # refreshed whenever one starts or stops serving
        for _ in range(prefill):
            self._start("prefill", ready_at=0.0)
        for _ in range(decode):
            self._start("decode", ready_at=0.0)
        self._refresh()

    # -- engines ---------------------------------------------------------------------------------------------------------
    def _start(self, role: Role, ready_at: float) -> None:
        self.engines[role].append(_Engine(role, len(self.engines[role]), self.now, ready_at))
        if ready_at > self.now:
            self._at(ready_at, "ready", None)

    def _refresh(self) -> None:
        for role in ("prefill", "decode"):
            self.serving[role] = [e for e in self.engines[role] if e.stopped is None and not e.draining and e.ready_at <= self.now]

    def _serving(self, role: Role) -> list[_Engine]:
        return self.serving[role]

    def _pick(self, role: Role) -> _Engine | None:
        serving = self.serving[role]
        if not serving:
            return None
        self.rr[role] += 1
        return serving[self.rr[role] % len(serving)]

    def _stop_if_drained(self, e: _Engine) -> None:
        if e.draining and e.stopped is None and e.empty():
            e.stopped = self.now

    def _reconcile(self, role: Role, want: int) -> None:
        live = [e for e in self.engines[role] if e.stopped is None and not e.draining]
        for _ in range(want - len(live)):
            self._start(role, self.now + self.config.startup_s)
        for e in sorted(live, key=lambda e: (e.ready_at <= self.now, -e.started))[: max(0, len(live) - want)]:
            if e.ready_at > self.now and e.empty():
                e.stopped = self.now  # not serving yet, nothing waiting on it
            else:
                e.draining = True
                self._stop_if_drained(e)

    # -- events ----------------------------------------------------------------------------------------------------------
    def _at(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def _next_arrival(self) -> None:
        t = self.now
        while True:
            t += self.rng.expovariate(self.peak)
            if t >= self.config.duration_s:
                return
            if self.rng.random() * self.peak <= self.rate_at(t):
                self._at(t, "arrive", None)
                return

    def _arrive(self) -> None:
        rid = len(self.arrival)
        self.arrival.append(self.now)
        self.prompt.append(self.rng.choice(self.workload.prompt_tokens))
        self.output.append(self.rng.choice(self.workload.output_tokens))
        self.first.append(math.nan)
        self.done.append(math.nan)
        p = self._pick("prefill")
        if p is None:  # no P serving: wait on the first one starting
            p = min((e for e in self.engines["prefill"] if e.stopped is None), key=lambda e: e.ready_at)
        p.queue.append(rid)
        self._prefill_next(p)
        self._next_arrival()

    def _prefill_next(self, p: _Engine) -> None:
        if p.busy or not p.queue or p.ready_at > self.now:
            if p.queue and not p.busy and p.ready_at > self.now:
                self._at(p.ready_at, "p_ready", p)
            return
        batch, tokens, squares = [], 0, 0
        while p.queue and (not batch or tokens + self.prompt[p.queue[0]] <= self.config.max_batch_tokens):
            rid = p.queue.popleft()
            batch.append(rid)
            tokens += self.prompt[rid]
            squares += self.prompt[rid] ** 2
        p.busy = True
        self.prefill_forwards += 1
        self.prefilled += len(batch)
        self._at(self.now + self.profile.prefill_fit.step_ms(tokens, squares, len(batch)) / 1000, "p_done", (p, batch))

    def _prefill_done(self, p: _Engine, batch: list[int]) -> None:
        p.busy = False
        for rid in batch:
            # The request's time outside P's engine (HTTP, API server) holds no engine: a delay, as the handover is.
            self._at(self.now + (self.profile.handover_ms + self.profile.prefill_fit.outside_ms) / 1000, "d_join", rid)
        self._prefill_next(p)
        self._stop_if_drained(p)

    def _advance(self, d: _Engine) -> None:
        if d.count and d.step_ms > 0:
            d.progress += (self.now - d.last_t) * 1000 / d.step_ms
        d.last_t = self.now

    def _retime(self, d: _Engine) -> None:
        d.version += 1
        if not d.count:
            d.step_ms = 0.0
            return
        kv = d.prompt_sum + d.count * d.progress - d.join_sum
        d.step_ms = max(MIN_STEP_MS, self.profile.decode_fit.itl_ms(d.count, kv))
        ends = d.finish[0][0]
        self._at(self.now + max(0.0, ends - d.progress) * d.step_ms / 1000, "d_check", (d, d.version))

    def _admit(self, d: _Engine, rid: int) -> bool:
        need = self.prompt[rid] + self.output[rid]
        capacity = self.profile.model.kv_capacity_tokens
        if capacity is not None and d.count and d.kv_reserved + need > capacity:
            return False
        d.kv_reserved += need
        d.count += 1
        d.prompt_sum += self.prompt[rid]
        d.join_sum += d.progress
        heapq.heappush(d.finish, (d.progress + self.output[rid], rid))
        return True

    def _join(self, rid: int) -> None:
        d = self._pick("decode")
        if d is None:
            d = min((e for e in self.engines["decode"] if e.stopped is None), key=lambda e: e.ready_at)
        self._advance(d)
        if d.waiting or not self._admit(d, rid):
            d.waiting.append(rid)
            return
        self._retime(d)
        self.first[rid] = self.now + d.step_ms / 1000

    def _check(self, d: _Engine, version: int) -> None:
        if version != d.version:
            return
        self._advance(d)
        while d.finish and d.finish[0][0] <= d.progress + FINISH_SLACK:
            ends, rid = heapq.heappop(d.finish)
            self.done[rid] = self.now
            d.count -= 1
            d.prompt_sum -= self.prompt[rid]
            d.join_sum -= ends - self.output[rid]
            d.kv_reserved -= self.prompt[rid] + self.output[rid]
        admitted = []
        while d.waiting and self._admit(d, d.waiting[0]):
            admitted.append(d.waiting.popleft())
        self._retime(d)
        for rid in admitted:
            self.first[rid] = self.now + d.step_ms / 1000
        self._stop_if_drained(d)

    # -- the signal ------------------------------------------------------------------------------------------------------
    def _tick(self) -> None:
        cfg = self.config
        lo = bisect.bisect_left(self.arrival, self.now - cfg.window_s)
        recent = range(lo, len(self.arrival))
        stride = max(1, len(recent) // WINDOW_LENGTHS)
        seen = [i for i in recent if self.first[i] == self.first[i] and self.first[i] <= self.now]
        ttft = _quantile([(self.first[i] - self.arrival[i]) * 1000 for i in seen], self.slo.quantile)
        itl = _quantile([_itl_ms(self, i) for i in seen if self.done[i] <= self.now and self.output[i] > 1], self.slo.quantile)
        serving = {role: len(self._serving(role)) for role in ("prefill", "decode")}
        if self.signal is not None:
            obs = Observation(at_s=self.now, rate=len(recent) / min(cfg.window_s, max(self.now, cfg.interval_s)),
                              prompt_tokens=[self.prompt[i] for i in recent[::stride]],
                              output_tokens=[self.output[i] for i in recent[::stride]],
                              prefill_engines=max(1, serving["prefill"]), decode_engines=max(1, serving["decode"]),
                              prefill_waiting=float(sum(len(e.queue) for e in self._serving("prefill"))),
                              ttft_ms=ttft, itl_ms=itl)  # fmt: skip
            want = self.signal.update(obs)
            self.desired = {"prefill": want.prefill, "decode": want.decode}
            for role in ("prefill", "decode"):
                self._reconcile(role, self.desired[role])  # type: ignore[arg-type]
            self._refresh()
        self.timeline.append(TimelinePoint(self.now, self.rate_at(self.now), serving["prefill"], serving["decode"],
                                           self.desired["prefill"], self.desired["decode"]))  # fmt: skip
        if self.now + cfg.interval_s < cfg.duration_s:
            self._at(self.now + cfg.interval_s, "tick", None)

    def run(self) -> SimResult:
        self._next_arrival()
        self._at(0.0, "tick", None)
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive()
            elif kind == "p_done":
                self._prefill_done(*payload)  # type: ignore[misc]
            elif kind == "p_ready":
                self._prefill_next(payload)  # type: ignore[arg-type]
            elif kind == "d_join":
                self._join(payload)  # type: ignore[arg-type]
            elif kind == "d_check":
                self._check(*payload)  # type: ignore[misc]
            elif kind == "ready":
                self._refresh()
            else:
                self._tick()
        return self._result()

    def _result(self) -> SimResult:
        end = max(self.now, self.config.duration_s)
        hours = {role: sum(((e.stopped if e.stopped is not None else end) - e.started) for e in self.engines[role]) / 3600
                 for role in ("prefill", "decode")}  # fmt: skip
        n = len(self.arrival)
        ttft = [(f - a) * 1000 for f, a in zip(self.first, self.arrival, strict=True)]
        itl = [_itl_ms(self, i) for i in range(n)]
        ok_t = [t <= self.slo.ttft_ms for t in ttft]
        ok_i = [v <= self.slo.itl_ms for v in itl]
        both = sum(a and b for a, b in zip(ok_t, ok_i, strict=True))
        share = (lambda k: k / n) if n else (lambda k: 1.0)
        peak = {role: max((p.prefill if role == "prefill" else p.decode) for p in self.timeline) if self.timeline else 0
                for role in ("prefill", "decode")}  # fmt: skip
        return SimResult(requests=n, attainment=share(both), ttft_attainment=share(sum(ok_t)), itl_attainment=share(sum(ok_i)),
                         ttft_p50_ms=_quantile(ttft, 0.5) or 0.0, ttft_p90_ms=_quantile(ttft, 0.9) or 0.0,
                         itl_p90_ms=_quantile(itl, 0.9) or 0.0, engine_hours=hours["prefill"] + hours["decode"],
                         prefill_engine_hours=hours["prefill"], decode_engine_hours=hours["decode"],
                         peak_prefill=peak["prefill"], peak_decode=peak["decode"], timeline=self.timeline)  # fmt: skip


def _itl_ms(sim: Simulation, i: int) -> float:
    """Request i's mean gap between tokens after its first (0 for a one-token output)."""
    if sim.output[i] <= 1:
        return 0.0
    return (sim.done[i] - sim.first[i]) * 1000 / (sim.output[i] - 1)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

"""The typed results of `pdkv trace`: events on lanes, TTFT phases, transfer facts, repeat statistics.

Times inside a `Trace` are unix seconds on the clock of the process that
recorded them (`TraceEvent.lane`: client, proxy, P, D); `t_ms` places every
event on one axis, in ms since the proxy received the request. Phases record
which clocks they read, so a reader knows which numbers depend on the hosts'
clocks agreeing.
"""

from __future__ import annotations

import msgspec

from pdkv.proxy_api import ProxyTiming
from pdkv.wire import TransferTrace

Lane = str  # "client" | "proxy" | "P" | "D"
LANES: tuple[Lane, ...] = ("client", "proxy", "P", "D")


class ClientTiming(msgspec.Struct, frozen=True, kw_only=True):
    """What the tracing client measured itself: unix seconds, durations from one monotonic clock.

    `first_token` is when the first streamed completion text arrived; `done`
    when the stream ended. Usage counts come from the response's usage field.
    """

    sent: float
    first_token: float | None = None
    done: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class TraceEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded moment: `name` as the recorder calls it, its step(s) in docs/timeline.md, where it happened."""

    name: str
    step: str
    lane: Lane
    what: str
    at: float
    t_ms: float


class Phase(msgspec.Struct, frozen=True, kw_only=True):
    """One term of the TTFT decomposition, from event `start` to event `end`.

    An end that reads earlier than its start (two hosts' clocks disagreeing)
    is moved to the start, so `ms` is never negative and the phases still
    add up; the trace's notes say so.

    `clocks` lists the lanes whose clocks the two ends were read on; a phase
    with two lanes `crosses_clocks` and is exact only when those hosts'
    clocks agree (always, on one host).
    """

    name: str
    steps: str
    start: str
    end: str
    ms: float
    share: float
    start_ms: float  # on the trace's axis (ms since the proxy received the request), after any clamping
    end_ms: float
    clocks: list[Lane]
    crosses_clocks: bool
    note: str = ""


class TransferFacts(msgspec.Struct, frozen=True, kw_only=True):
    """The KV write as P's connector recorded it, beside the link's floor for the same bytes.

    `bytes` and `descriptors` add up every P worker (TP rank); `write_ms` and
    `floor_ms` are those of the slowest worker (the one the decode waits on).
    """

    bytes: int
    descriptors: int
    workers: int
    write_ms: float | None
    floor_ms: float
    link_gbps: float
    achieved_gbps: float | None
    status: str = ""
    error: str = ""


class Trace(msgspec.Struct, kw_only=True):
    """One request's timeline in the terms of docs/timeline.md. `phases` add up to `proxy_ttft_ms`."""

    request_id: str
    transfer_id: str
    model: str = ""
    prompt_tokens: int | None = None
    requested_prompt_tokens: int | None = None
    completion_tokens: int | None = None
    connector_visible: bool = False
    one_host: bool = True
    client_ttft_ms: float | None = None
    proxy_ttft_ms: float | None = None
    total_ms: float | None = None
    events: list[TraceEvent] = []
    phases: list[Phase] = []
    transfer: TransferFacts | None = None
    notes: list[str] = []
    proxy: ProxyTiming | None = None
    connector: list[TransferTrace] = []

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)

    @property
    def phases_ms(self) -> float:
        return sum(p.ms for p in self.phases)


class PhaseStats(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    steps: str
    n: int
    p50_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float


class TraceSummary(msgspec.Struct, frozen=True, kw_only=True):
    """p50/p90 over repeated traces: each phase, the TTFTs and the KV write."""

    runs: int
    phases: list[PhaseStats]
    client_ttft: PhaseStats | None = None
    proxy_ttft: PhaseStats | None = None
    transfer_write: PhaseStats | None = None


class TraceResult(msgspec.Struct, kw_only=True):
    """What `pdkv trace --json` prints: every run, and the summary when there was more than one."""

    traces: list[Trace]
    summary: TraceSummary | None = None

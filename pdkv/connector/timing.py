"""Per-transfer timing (the steps of docs/timeline.md, unix seconds) and the connector's Prometheus metrics.

Event names, in seed order:

    P: registered (12), p_forward_done (15: a one-token request's prompt is computed,
       its write may start), p_computed and p_finished (23), pull_received (22), transfer_start (28),
       kv_ready (15: on a GPU, the forward done there; the write waits for it),
       transfer_end (29), reply_sent (30), freed (32-33)
    D: pull_scheduled (18-19), pull_sent (21), notified (34), reported (35),
       first_token_scheduled (37-38)

P holds the whole trace: D reports its events to P over the side channel
once its first token is scheduled. `TraceLog.query` serves `pdkv trace`
(StatsQuery on P's side channel, whose address the bootstrap registry
lists); `trace_dir` also gets one JSON line per transfer. The metrics text
(`render_metrics`, through prometheus_client) travels in the same StatsReply.
The same counts since the last `take_stats` travel to the engine's own /metrics
through vLLM's connector stats (pdkv.connector.prom).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, Counter

from pdkv.metrics import histogram, render
from pdkv.wire import TransferTrace

MAX_TRACES = 10_000
MAX_OBSERVATIONS = 4096  # per histogram between two takes: a step is milliseconds, so never reached but under a stall


class ConnectorDelta(msgspec.Struct, kw_only=True):
    """The connector's counts and histogram observations over an interval; vLLM sums the TP ranks' with `add`."""

    transfers: dict[str, int] = msgspec.field(default_factory=dict)  # by outcome
    auth_refused: dict[str, int] = msgspec.field(default_factory=dict)  # by reason
    bytes: int = 0
    descriptors: int = 0
    malformed: int = 0
    transfer_s: list[float] = msgspec.field(default_factory=list)
    handover_s: list[float] = msgspec.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.transfers or self.auth_refused or self.bytes or self.malformed or self.transfer_s or self.handover_s)

    def add(self, other: ConnectorDelta) -> None:
        for label, n in other.transfers.items():
            _count(self.transfers, label, n)
        for label, n in other.auth_refused.items():
            _count(self.auth_refused, label, n)
        self.bytes += other.bytes
        self.descriptors += other.descriptors
        self.malformed += other.malformed
        for value in other.transfer_s:
            _observe(self.transfer_s, value)
        for value in other.handover_s:
            _observe(self.handover_s, value)


def _count(by: dict[str, int], label: str, n: int = 1) -> None:
    by[label] = by.get(label, 0) + n


def _observe(values: list[float], value: float) -> None:
    if len(values) < MAX_OBSERVATIONS:
        values.append(value)


class TraceLog:
    """Thread-safe store of TransferTrace records plus counters; bounded to MAX_TRACES."""

    def __init__(self, role: str, trace_dir: str | None = None, *, engine_id: str = "", tp_rank: int = 0) -> None:
        self.role, self.tp_rank = role, tp_rank
        self._lock = threading.Lock()
        self._traces: OrderedDict[str, TransferTrace] = OrderedDict()
        self._file = None
        if trace_dir:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(trace_dir) / f"pdkv-{role}-{engine_id or 'engine'}-tp{tp_rank}.jsonl", "ab")  # noqa: SIM115 - closed in close()
        self.registry = r = CollectorRegistry()
        self._outcomes = Counter("pdkv_connector_transfers_total", "Transfers by outcome.", ["role", "outcome"], registry=r)
        self._bytes = Counter("pdkv_connector_bytes_total", "KV bytes written to decode engines.", ["role"], registry=r).labels(role)
        self._descriptors = Counter("pdkv_connector_descriptors_total", "Write descriptors issued.", ["role"], registry=r).labels(role)
        self._malformed = Counter(
            "pdkv_connector_malformed_total", "Side-channel messages refused as malformed.", ["role"], registry=r
        ).labels(role)
        self._auth_refused = Counter(
            "pdkv_connector_auth_refused_total", "Side-channel frames dropped for their seal (deployment key set).",
            ["role", "reason"], registry=r,
        )
        self.transfer_s = histogram("pdkv_connector_transfer_seconds", "Duration of one KV write.", r, ["role"]).labels(role)
        self.handover_s = histogram(
            "pdkv_connector_handover_seconds", "P prefill done to D first token scheduled.", r, ["role"]
        ).labels(role)
        self._delta = ConnectorDelta()  # guarded by _lock: what happened since the last take_stats

    def take_stats(self) -> ConnectorDelta | None:
        """What was counted since the last call (None if nothing): vLLM's connector stats, once per step."""
        with self._lock:
            if self._delta.empty:
                return None
            out, self._delta = self._delta, ConnectorDelta()
            return out

    def malformed(self) -> None:
        """Count one side-channel message refused as malformed."""
        self._malformed.inc()
        with self._lock:
            self._delta.malformed += 1

    def auth_refused(self, reason: str) -> None:
        """Count one side-channel frame dropped as unauthenticated, stale or replayed."""
        self._auth_refused.labels(self.role, reason).inc()
        with self._lock:
            _count(self._delta.auth_refused, reason)

    def auth_refused_total(self, reason: str) -> int:
        return int(self.registry.get_sample_value("pdkv_connector_auth_refused_total", {"role": self.role, "reason": reason}) or 0)

    @property
    def malformed_total(self) -> int:
        return int(self.registry.get_sample_value("pdkv_connector_malformed_total", {"role": self.role}) or 0)

    def _get(self, tid: str) -> TransferTrace:
        t = self._traces.get(tid)
        if t is None:
            t = self._traces[tid] = TransferTrace(transfer_id=tid, p_rank=self.tp_rank if self.role == "prefill" else 0)
            while len(self._traces) > MAX_TRACES:
                self._traces.popitem(last=False)
        return t

    def event(self, tid: str, name: str, at: float | None = None, **fields: object) -> None:
        with self._lock:
            t = self._get(tid)
            t.events[name] = time.time() if at is None else at
            for k, v in fields.items():
                setattr(t, k, v)

    def merge(self, tid: str, events: dict[str, float], first_step_tokens: int = 0) -> None:
        """Add a peer's events (D's, on P) and observe the handover if it is now complete."""
        with self._lock:
            t = self._get(tid)
            t.events.update(events)
            t.first_step_tokens = first_step_tokens or t.first_step_tokens
            ev = t.events
            # From P's prefill being done (its forward, or the finish when it was not sent early).
            start = [ev[k] for k in ("p_forward_done", "p_finished") if k in ev]
            if "first_token_scheduled" in ev and start:
                handover = max(0.0, ev["first_token_scheduled"] - min(start))
                self.handover_s.observe(handover)
                _observe(self._delta.handover_s, handover)
            self._write(t)

    def finish(self, tid: str, status: str, error: str = "", nbytes: int = 0, descriptors: int = 0, d_rank: int | None = None) -> None:
        """`d_rank`: the D rank written, where several D ranks take their heads from this P rank: the
        transfer's bytes are then the sum over them (`d_rank_bytes`)."""
        with self._lock:
            t = self._get(tid)
            t.status, t.error = status, error
            if nbytes and d_rank is not None:
                if str(d_rank) not in t.d_rank_bytes:
                    t.descriptors += descriptors
                t.d_rank_bytes[str(d_rank)] = nbytes
                t.bytes = sum(t.d_rank_bytes.values())
            elif nbytes:
                t.bytes, t.descriptors = nbytes, descriptors
            if nbytes:
                self._bytes.inc(nbytes)
                self._descriptors.inc(descriptors)
                self._delta.bytes += nbytes
                self._delta.descriptors += descriptors
                start = t.events.get("kv_ready", t.events.get("transfer_start"))  # on a GPU: once P's forward is done there
                if start is not None and "transfer_end" in t.events:
                    self.transfer_s.observe(t.events["transfer_end"] - start)
                    _observe(self._delta.transfer_s, t.events["transfer_end"] - start)
            self._outcomes.labels(self.role, status).inc()
            _count(self._delta.transfers, status)
            if self.role == "decode" or status != "sent":
                self._write(t)

    def _write(self, t: TransferTrace) -> None:
        if self._file is not None:
            self._file.write(msgspec.json.encode(t) + b"\n")
            self._file.flush()

    def get(self, tid: str) -> TransferTrace | None:
        with self._lock:
            t = self._traces.get(tid)
            return msgspec.structs.replace(t, events=dict(t.events), d_rank_bytes=dict(t.d_rank_bytes)) if t else None

    def query(self, since: float = 0.0, limit: int = 1000) -> list[TransferTrace]:
        with self._lock:
            out = [
                msgspec.structs.replace(t, events=dict(t.events), d_rank_bytes=dict(t.d_rank_bytes))
                for t in self._traces.values()
                if max(t.events.values(), default=0.0) >= since
            ]
        return out[-limit:]

    def render_metrics(self) -> str:
        """This worker's counters and histograms in the Prometheus text format."""
        with self._lock:  # every figure from one moment
            return render(self.registry)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

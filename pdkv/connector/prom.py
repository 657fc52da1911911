"""The connector's figures on the engine's own /metrics, through vLLM's connector stats.

Each worker's TraceLog hands vLLM what it counted since the last step (a
`ConnectorDelta`, as `PdkvConnectorStats`); vLLM sums the TP ranks'
(`aggregate`), carries the sum to its API server, and `PdkvPromMetrics.observe`
adds it there to these metrics, beside vLLM's own labels (model_name, engine):

    pdkv_connector_transfers_total{role,outcome}      transfers concluded, by outcome; on D `failed` is a pull
                                                      whose KV did not come (recomputed under the recompute policy)
    pdkv_connector_bytes_total{role}                  KV bytes written to decode engines
    pdkv_connector_descriptors_total{role}            write descriptors issued
    pdkv_connector_malformed_total{role}              side-channel messages refused as malformed
    pdkv_connector_auth_refused_total{role,reason}    side-channel frames dropped for their seal
    pdkv_connector_transfer_seconds{role}             histogram: one KV write
    pdkv_connector_handover_seconds{role}             histogram: P's prefill done to D's first token scheduled (on P)

The names are those of the side channel's StatsReply text (pdkv.connector.timing): one name per figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from pdkv.connector.timing import ConnectorDelta
from pdkv.metrics import BUCKETS_S

# Shown at 0 from the start, so a rule over them has data before the first failure.
OUTCOMES = {"prefill": ("sent", "failed", "cancelled", "expired", "released", "duplicate", "unknown"), "decode": ("sent", "failed")}
AUTH_REASONS = ("unauthenticated", "stale", "replayed")


@dataclass
class PdkvConnectorStats(KVConnectorStats):
    """A ConnectorDelta as vLLM carries connector stats: a plain dict in `data`."""

    @classmethod
    def of(cls, delta: ConnectorDelta) -> PdkvConnectorStats:
        return cls(data=msgspec.to_builtins(delta))

    def delta(self) -> ConnectorDelta:
        return msgspec.convert(self.data, ConnectorDelta)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        total = self.delta()
        total.add(msgspec.convert(other.data, ConnectorDelta))
        self.data = msgspec.to_builtins(total)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.delta()
        return {"transfers": sum(d.transfers.values()), "failed": d.transfers.get("failed", 0), "bytes": d.bytes}

    def is_empty(self) -> bool:
        return self.delta().empty


class PdkvPromMetrics(KVConnectorPromMetrics):
    """The connector's metrics in vLLM's API server, one set of children per engine index."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        role = "prefill" if vllm_config.kv_transfer_config.kv_role == "kv_producer" else "decode"
        names = [*labelnames, "role"]
        counter, histogram = self._counter_cls, self._histogram_cls
        transfers = counter(name="pdkv_connector_transfers_total", documentation="Transfers by outcome.", labelnames=[*names, "outcome"])
        nbytes = counter(name="pdkv_connector_bytes_total", documentation="KV bytes written to decode engines.", labelnames=names)
        descriptors = counter(name="pdkv_connector_descriptors_total", documentation="Write descriptors issued.", labelnames=names)
        malformed = counter(name="pdkv_connector_malformed_total", documentation="Side-channel messages refused as malformed.",
                            labelnames=names)  # fmt: skip
        refused = counter(name="pdkv_connector_auth_refused_total", labelnames=[*names, "reason"],
                          documentation="Side-channel frames dropped for their seal (deployment key set).")  # fmt: skip
        transfer_s = histogram(name="pdkv_connector_transfer_seconds", documentation="Duration of one KV write.", labelnames=names,
                               buckets=BUCKETS_S)  # fmt: skip
        handover_s = histogram(name="pdkv_connector_handover_seconds", documentation="P prefill done to D first token scheduled.",
                               labelnames=names, buckets=BUCKETS_S)  # fmt: skip
        self._engines: dict[int, _EngineChildren] = {}
        for idx, values in per_engine_labelvalues.items():
            labels = [*values, role]
            self._engines[idx] = _EngineChildren(
                transfers={o: transfers.labels(*labels, o) for o in OUTCOMES[role]}, transfers_metric=transfers, labels=labels,
                bytes=nbytes.labels(*labels), descriptors=descriptors.labels(*labels), malformed=malformed.labels(*labels),
                refused={r: refused.labels(*labels, r) for r in AUTH_REASONS}, refused_metric=refused,
                transfer_s=transfer_s.labels(*labels), handover_s=handover_s.labels(*labels),
            )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        children = self._engines.get(engine_idx)
        if children is not None:
            children.add(msgspec.convert(transfer_stats_data, ConnectorDelta))


@dataclass
class _EngineChildren:
    transfers: dict[str, Any]
    transfers_metric: Counter
    labels: list[object]
    bytes: Any
    descriptors: Any
    malformed: Any
    refused: dict[str, Any]
    refused_metric: Counter
    transfer_s: Histogram
    handover_s: Histogram

    def add(self, d: ConnectorDelta) -> None:
        for outcome, n in d.transfers.items():
            child = self.transfers.get(outcome)
            if child is None:
                child = self.transfers[outcome] = self.transfers_metric.labels(*self.labels, outcome)
            child.inc(n)
        for reason, n in d.auth_refused.items():
            child = self.refused.get(reason)
            if child is None:
                child = self.refused[reason] = self.refused_metric.labels(*self.labels, reason)
            child.inc(n)
        if d.bytes:
            self.bytes.inc(d.bytes)
        if d.descriptors:
            self.descriptors.inc(d.descriptors)
        if d.malformed:
            self.malformed.inc(d.malformed)
        for v in d.transfer_s:
            self.transfer_s.observe(v)
        for v in d.handover_s:
            self.handover_s.observe(v)

"""Assembling one request's timeline from the proxy's, the client's and the connector's records (pure).

The TTFT decomposition is a chain of anchors, each phase the gap between
two consecutive ones, so the phases add up to the proxy's TTFT by
construction; what a trace measures is where inside that time the request
was. With pdkv's connector the chain is that of docs/timeline.md, with its first P term
split at P's scheduling:

    received -> prefill_dispatched          proxy forward         (8-10)
    -> registered                           P queue               (11)
    -> p_computed                           P prefill             (12-15)
    -> p_finished                           P next step           (23-27)
    -> transfer_start                       wait for D's pull     (16-22; ~0 when D asked first)
    -> notified                             transfer              (28-30)
    -> first_token_scheduled                D notified            (34-37)
    -> decode_first_byte                    D one-token forward   (38-39)

On a GPU, P's forward is still running when its launch returns: the write
first waits for it (`kv_ready`), and that wait is P's, not the transfer's:

    transfer_start -> kv_ready              P forward on the GPU  (15)
    -> notified                             transfer              (28-30)

When P started the write right after its prefill forward (`p_forward_done`,
a one-token P request), P's sampling and finish run beside the transfer,
off the path to D's first token, and the chain is:

    received -> prefill_dispatched          proxy forward         (8-10)
    -> registered                           P queue               (11)
    -> p_forward_done                       P prefill             (12-15)
    -> transfer_start                       wait for D's pull     (16-22; ~0 when D asked first)
    -> notified                             transfer              (28-30)
    -> first_token_scheduled                D notified            (34-37)
    -> decode_first_byte                    D one-token forward   (38-39)

`p_computed` (the scheduler seeing P's request finished) is recorded only
by connector builds that have it; without it "P prefill + P next step"
is one phase. Any missing anchor merges its two neighbouring phases
likewise. Without the connector's records (vLLM's MooncakeConnector) the
chain is the proxy's alone: forward, P's request as the proxy sees it, and
the wait from P's answer to D's first token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from pdkv.proxy_api import ProxyTiming
from pdkv.wire import TransferTrace
from pdkv.trace.model import (
    ClientTiming,
    Lane,
    Phase,
    PhaseStats,
    Trace,
    TraceEvent,
    TraceSummary,
    TransferFacts,
)

# name -> (steps, lane, what happens). Connector event names are pdkv.connector.timing's.
EVENTS: dict[str, tuple[str, Lane, str]] = {
    "client_sent": ("8", "client", "client sends the request"),
    "received": ("8", "proxy", "proxy receives the request"),
    "prefill_dispatched": ("9", "proxy", "proxy sends P its copy (max_tokens 1)"),
    "decode_dispatched": ("10", "proxy", "proxy sends D its copy (remote prefill)"),
    "registered": ("12-14", "P", "P schedules the prompt; its worker records the pending send"),
    "pull_scheduled": ("17-19", "D", "D allocates blocks and waits for remote KV"),
    "pull_sent": ("20-21", "D", "D tells P where to write (side channel)"),
    "pull_received": ("22", "P", "P receives D's pull"),
    "p_forward_done": ("15, 28", "P", "P's prefill forward done: the KV write may start"),
    "p_computed": ("15, 23", "P", "P's prefill done: one token, request finished"),
    "prefill_responded": ("24-25", "proxy", "P's answer reaches the proxy (discarded)"),
    "p_finished": ("26-27", "P", "P's next step hands the block ids to the sender"),
    "transfer_start": ("28", "P", "P starts the KV write"),
    "kv_ready": ("15", "P", "P's forward done on the GPU: the KV is there to read"),
    "transfer_end": ("29", "P", "KV write done"),
    "reply_sent": ("30-31", "P", "P tells D the KV is there"),
    "notified": ("34", "D", "D's receiver learns the KV arrived"),
    "freed": ("32-33", "P", "P frees the prompt's blocks"),
    "reported": ("35-36", "D", "D's worker reports the pull finished"),
    "first_token_scheduled": ("37-38", "D", "D schedules the one-token forward"),
    "decode_first_byte": ("39", "proxy", "D's first token reaches the proxy"),
    "client_first_token": ("39", "client", "client receives the first token"),
    "last_byte": ("42", "proxy", "D's last byte leaves the proxy"),
    "client_done": ("43", "client", "client receives the whole answer"),
}

# (anchor, name of the phase that starts there, its steps)
PDKV_CHAIN: tuple[tuple[str, str, str], ...] = (
    ("received", "proxy forward", "8-10"),
    ("prefill_dispatched", "P queue", "11"),
    ("registered", "P prefill", "12-15"),
    ("p_computed", "P next step", "23-27"),
    ("p_finished", "wait for D's pull", "16-22"),
    ("transfer_start", "transfer", "28-30"),
    ("notified", "D notified", "34-37"),
    ("first_token_scheduled", "D one-token forward", "38-39"),
    ("decode_first_byte", "", ""),
)
# The early write: P's finish and next step leave the path; the wait for D's pull starts at the forward.
EARLY_CHAIN: tuple[tuple[str, str, str], ...] = (*PDKV_CHAIN[:3], ("p_forward_done", "wait for D's pull", "16-22"), *PDKV_CHAIN[5:])
# On a GPU: the write waits for P's forward to finish there (kv_ready) before it moves a byte.
GPU_TAIL: tuple[tuple[str, str, str], ...] = (("transfer_start", "P forward on the GPU", "15"), ("kv_ready", "transfer", "28-30"))
PROXY_CHAIN: tuple[tuple[str, str, str], ...] = (
    ("received", "proxy forward", "8-10"),
    ("prefill_dispatched", "P request (seen by the proxy)", "11-25"),
    ("prefill_responded", "P answered -> D's first token", "26-39"),
    ("decode_first_byte", "", ""),
)
SKEW_NOTE_MS = 0.2  # anchors out of order by less than this are timer resolution, not clocks


def link_floor_ms(nbytes: int, link_gbps: float) -> float:
    """The time `nbytes` take at `link_gbps` gigabits per second, in ms (pdkv.geometry's formula)."""
    return nbytes * 8 / (link_gbps * 1e9) * 1e3


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks; values must be non-empty."""
    s = sorted(values)
    if not s:
        raise ValueError("percentile of no values")
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def critical_record(records: Sequence[TransferTrace]) -> TransferTrace | None:
    """The P worker's record the decode waited on longest: the latest transfer end (or any event)."""
    if not records:
        return None
    return max(records, key=lambda r: (r.events.get("transfer_end", 0.0), max(r.events.values(), default=0.0)))


def _times(proxy: ProxyTiming, client: ClientTiming | None, record: TransferTrace | None) -> dict[str, float]:
    at: dict[str, float] = {}
    for name in ("received", "prefill_dispatched", "decode_dispatched", "prefill_responded", "decode_first_byte", "last_byte"):
        v = getattr(proxy, name)
        if v:
            at[name] = v
    if client is not None:
        at["client_sent"] = client.sent
        if client.first_token is not None:
            at["client_first_token"] = client.first_token
        if client.done is not None:
            at["client_done"] = client.done
    if record is not None:
        at.update({k: v for k, v in record.events.items() if k in EVENTS})
    return at


def _phases(at: dict[str, float], chain: Sequence[tuple[str, str, str]], origin: float) -> tuple[list[Phase], list[str]]:
    """Walk the chain; a missing anchor merges the phases on either side of it."""
    notes: list[str] = []
    present = [(a, name, steps) for a, name, steps in chain if a in at]
    if len(present) < 2:
        return [], notes
    phases: list[Phase] = []
    prev_t = at[present[0][0]]
    i = 0
    while i < len(present) - 1:
        anchor, name, steps = present[i]
        # The phases from this anchor up to the next recorded one become one phase.
        names = [a for a, _, _ in chain]
        k, k_next = names.index(anchor), names.index(present[i + 1][0])
        merged = [chain[j] for j in range(k, k_next)]
        full_name = " + ".join(m[1] for m in merged)
        first_step, last_step = merged[0][2].split("-")[0], merged[-1][2].split("-")[-1]
        full_steps = first_step if first_step == last_step else f"{first_step}-{last_step}"
        end = present[i + 1][0]
        t_end = at[end]
        lanes = [EVENTS[anchor][1], EVENTS[end][1]]
        if t_end < prev_t:
            gap_ms = (prev_t - t_end) * 1e3
            if lanes[0] != lanes[1] and gap_ms > SKEW_NOTE_MS:
                notes.append(f"{end} ({lanes[1]}) reads {gap_ms:.2f} ms before {anchor} ({lanes[0]}): those clocks disagree; counted as 0")
            t_end = prev_t
        ms = (t_end - prev_t) * 1e3
        clocks = list(dict.fromkeys(lanes))
        note = ""
        if len(merged) > 1:
            note = "merged: " + ", ".join(m[0] for m in merged[1:]) + " not recorded"
        phases.append(Phase(name=full_name, steps=full_steps, start=anchor, end=end, ms=ms, share=0.0,
                            start_ms=(prev_t - origin) * 1e3, end_ms=(t_end - origin) * 1e3,
                            clocks=clocks, crosses_clocks=len(clocks) > 1, note=note))
        prev_t = t_end
        i += 1
    total = sum(p.ms for p in phases) or 1.0
    return [msgspec.structs.replace(p, share=p.ms / total) for p in phases], notes


def bytes_by_rank(records: Sequence[TransferTrace]) -> str:
    """What each P worker wrote, into each D rank where several D ranks take heads from it (P and D of different
    TP sizes): "P0->D0 8,192 B, P0->D1 8,192 B (16,384 B in all)"."""
    parts: list[str] = []
    for r in sorted(records, key=lambda r: r.p_rank):
        if r.d_rank_bytes:
            parts += [f"P{r.p_rank}->D{d} {n:,} B" for d, n in sorted(r.d_rank_bytes.items(), key=lambda kv: int(kv[0]))]
        else:
            parts.append(f"P{r.p_rank} {r.bytes:,} B")
    return ", ".join(parts) + f" ({sum(r.bytes for r in records):,} B in all)"


def _transfer(records: Sequence[TransferTrace], crit: TransferTrace, link_gbps: float) -> TransferFacts:
    ev = crit.events
    start = ev.get("kv_ready", ev.get("transfer_start"))  # on a GPU the write begins once P's forward is done there
    write_s = ev["transfer_end"] - start if start is not None and "transfer_end" in ev else None
    achieved = crit.bytes * 8 / write_s / 1e9 if write_s and crit.bytes else None
    return TransferFacts(
        bytes=sum(r.bytes for r in records),
        descriptors=sum(r.descriptors for r in records),
        workers=len(records),
        write_ms=write_s * 1e3 if write_s is not None else None,
        floor_ms=link_floor_ms(crit.bytes, link_gbps),
        link_gbps=link_gbps,
        achieved_gbps=achieved,
        status=crit.status,
        error=crit.error,
    )


def assemble(
    proxy: ProxyTiming,
    records: Sequence[TransferTrace] = (),
    client: ClientTiming | None = None,
    *,
    link_gbps: float = 400.0,
    one_host: bool = True,
    model: str = "",
    requested_prompt_tokens: int | None = None,
    connector_note: str = "",
) -> Trace:
    """One request's Trace from the proxy's record, P's connector records for its transfer_id (one per
    P worker, D's events merged in by the connector) and the client's own timing.

    `records` empty means the connector's side is not visible (`connector_note` says why).
    """
    records = [r for r in records if r.transfer_id == proxy.transfer_id]
    crit = critical_record(records)
    at = _times(proxy, client, crit)
    received = at.get("received", proxy.received)
    events = sorted(
        (TraceEvent(name=n, step=EVENTS[n][0], lane=EVENTS[n][1], what=EVENTS[n][2], at=t, t_ms=(t - received) * 1e3)
         for n, t in at.items()),
        key=lambda e: (e.at, list(EVENTS).index(e.name)),
    )
    proxy_ttft_s = at["decode_first_byte"] - received if "decode_first_byte" in at else None
    if crit is None:
        chain = PROXY_CHAIN
    else:
        chain = EARLY_CHAIN if "p_forward_done" in crit.events else PDKV_CHAIN
        if "kv_ready" in crit.events:
            at_start = [a for a, _, _ in chain].index("transfer_start")
            chain = (*chain[:at_start], *GPU_TAIL, *chain[at_start + 1 :])
    phases, notes = _phases(at, chain, received)
    if proxy.route:  # why it went where it went (the kv-aware policy's placement)
        notes.insert(0, f"routed by kv-aware: {proxy.route}" + (" (decode alone, no P)" if proxy.local_prefill == "kv_local" else ""))
    if crit is None:
        notes.append(connector_note or "connector-side steps (11-37) are not visible: only the proxy's own times are shown")
    elif len(records) > 1:
        notes.append(f"{len(records)} P workers (TP ranks) moved this request: bytes are their sum, times the slowest's")
    if crit is not None and (len(records) > 1 or any(r.d_rank_bytes for r in records)):
        notes.append(f"bytes by TP rank: {bytes_by_rank(records)}")
    if crit is not None and crit.events.get("transfer_start", float("inf")) < crit.events.get("p_forward_done", float("-inf")):
        notes.append("P wrote this KV layer by layer during its forward (socket_write_layers): the write's time runs from "
                     "its first layer's start to its last layer's end, waits for the forward's layers included")
    if crit is not None and crit.status not in ("", "sent"):
        notes.append(f"the transfer ended as {crit.status}: {crit.error or 'no reason given'}")
    if proxy.error:
        notes.append(f"the proxy recorded an error: {proxy.error} (status {proxy.status})")
    if not one_host:
        crossing = sorted({p.name for p in phases if p.crosses_clocks})
        if crossing:
            notes.append("P, D and the proxy may run on different hosts: " + ", ".join(crossing)
                         + " read two clocks and are only as exact as those clocks agree (the total is one clock's)")
    return Trace(
        request_id=proxy.request_id,
        transfer_id=proxy.transfer_id,
        model=model,
        prompt_tokens=client.prompt_tokens if client else None,
        requested_prompt_tokens=requested_prompt_tokens,
        completion_tokens=client.completion_tokens if client else None,
        connector_visible=crit is not None,
        one_host=one_host,
        client_ttft_ms=(client.first_token - client.sent) * 1e3 if client and client.first_token is not None else None,
        proxy_ttft_ms=proxy_ttft_s * 1e3 if proxy_ttft_s is not None else None,
        total_ms=(client.done - client.sent) * 1e3 if client and client.done is not None else None,
        events=events,
        phases=phases,
        transfer=_transfer(records, crit, link_gbps) if crit is not None and crit.bytes else None,
        notes=notes,
        proxy=proxy,
        connector=list(records),
    )


def _stats(name: str, steps: str, values: Sequence[float]) -> PhaseStats:
    return PhaseStats(name=name, steps=steps, n=len(values), p50_ms=percentile(values, 50), p90_ms=percentile(values, 90),
                      min_ms=min(values), max_ms=max(values))


def summarize(traces: Iterable[Trace]) -> TraceSummary:
    """p50/p90 per phase (by name, in first-seen order) and of the TTFTs and KV write over `traces`."""
    traces = list(traces)
    by_name: dict[str, tuple[str, list[float]]] = {}
    for t in traces:
        for p in t.phases:
            by_name.setdefault(p.name, (p.steps, []))[1].append(p.ms)

    def opt(name: str, values: list[float]) -> PhaseStats | None:
        return _stats(name, "", values) if values else None

    return TraceSummary(
        runs=len(traces),
        phases=[_stats(n, steps, v) for n, (steps, v) in by_name.items()],
        client_ttft=opt("client TTFT", [t.client_ttft_ms for t in traces if t.client_ttft_ms is not None]),
        proxy_ttft=opt("proxy TTFT", [t.proxy_ttft_ms for t in traces if t.proxy_ttft_ms is not None]),
        transfer_write=opt("KV write", [t.transfer.write_ms for t in traces if t.transfer and t.transfer.write_ms is not None]),
    )

"""D's side of the per-transfer state, pure as P's (pdkv.connector.send_table): what D's scheduler asks its
workers to pull (`PullSpec`), and the pulls in flight (`PullTracker`, keyed by D's request id). A pull is
live while P keeps answering; silence longer than `liveness_s` fails it, counted from when P was asked
(`expect`), and before that from when the pull started (finding P's side channel takes that long at most).
Where P's TP is larger than D's, one pull asks several P ranks (`expect`): it succeeds once every one of them
is done, and fails with the first error.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def write_key(transfer_id: str, d_req_id: str) -> str:
    """The name P's writes of one pull carry and D's transport grants them under (Transport.expect): the pull's
    transfer id and D's request id, hashed to a fixed length."""
    return hashlib.sha256(f"{transfer_id}\0{d_req_id}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class PullSpec:
    """One pull the scheduler asked for. `error` set: fail it at once (invalid params)."""

    d_req_id: str
    transfer_id: str
    bootstrap_addr: str
    engine_id: str
    block_ids: list[int]
    first_block: int = 0
    error: str | None = None
    binding: str = ""  # the transfer's binding secret from D's kv_transfer_params ("" when the proxy set none)


@dataclass
class PullEntry:
    d_req_id: str
    transfer_id: str
    deadline: float
    aborted: bool = False
    blocks: tuple[int, ...] = ()  # D's blocks P writes into
    waiting: set[str] = field(default_factory=set)  # the P ranks (side-channel addresses) still to answer DONE
    asked: bool = False  # the P ranks are known and about to be asked (`expect`); before: finding them
    bytes: int = 0  # what the P ranks done so far wrote
    descriptors: int = 0


@dataclass
class PullOutcome:
    d_req_id: str
    transfer_id: str
    error: str | None  # None: the KV arrived
    # D's blocks whose KV cannot be trusted: every block of a failed pull, since P may have written any part of
    # any of them before it failed (one write moves them all); none when the KV arrived or D no longer wants it.
    failed_blocks: tuple[int, ...] = ()


@dataclass
class PullTracker:
    """D's pulls in flight. Silence from P longer than `liveness_s` fails a pull."""

    liveness_s: float = 10.0
    entries: dict[str, PullEntry] = field(default_factory=dict)

    def started(self, d_req_id: str, transfer_id: str, now: float, blocks: tuple[int, ...] = ()) -> None:
        self.entries[d_req_id] = PullEntry(d_req_id, transfer_id, now + self.liveness_s, blocks=tuple(blocks))

    def heard(self, d_req_id: str, now: float) -> None:
        """P said it is still working on this pull: it is alive, keep waiting."""
        e = self.entries.get(d_req_id)
        if e is not None:
            e.deadline = now + self.liveness_s

    def expect(self, d_req_id: str, sources: list[str], now: float) -> None:
        """The pull asks every one of `sources` (P ranks) for its share now; it succeeds once each is done. P's
        silence is counted from here: the time spent finding P was not P's."""
        e = self.entries.get(d_req_id)
        if e is not None:
            e.waiting, e.asked, e.deadline = set(sources), True, now + self.liveness_s

    def part_done(self, d_req_id: str, source: str, nbytes: int = 0, descriptors: int = 0) -> PullOutcome | None:
        """P rank `source` wrote its share: the pull's outcome once no other rank is awaited, else None."""
        e = self.entries.get(d_req_id)
        if e is None or (e.waiting and source not in e.waiting):
            return None
        e.waiting.discard(source)
        e.bytes += nbytes
        e.descriptors += descriptors
        return None if e.waiting else self.finished(d_req_id, None)

    def finished(self, d_req_id: str, error: str | None) -> PullOutcome | None:
        e = self.entries.pop(d_req_id, None)
        if e is None:
            return None
        if e.aborted:
            return PullOutcome(d_req_id, e.transfer_id, error or "aborted by the decode side")
        return PullOutcome(d_req_id, e.transfer_id, error, e.blocks if error is not None else ())

    def abort(self, d_req_id: str) -> PullEntry | None:
        e = self.entries.get(d_req_id)
        if e is not None:
            e.aborted = True
        return e

    def tick(self, now: float) -> list[PullOutcome]:
        out = []
        for rid, e in list(self.entries.items()):
            if e.deadline <= now:
                del self.entries[rid]
                why = (f"prefill side silent for {self.liveness_s:g} s" if e.asked else
                       f"prefill side not reached within {self.liveness_s:g} s (its side channel not found in time)")
                out.append(PullOutcome(rid, e.transfer_id, why, () if e.aborted else e.blocks))
        return out

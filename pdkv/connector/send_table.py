"""P's per-transfer state (`SendTable`), a pure state machine: events in, actions out.

No sockets, threads or clocks: every event takes `now`, so each rule that
keeps a request from hanging is a unit test.

P side (`SendTable`, keyed by transfer_id, the only id D knows):

    (pull first) UNSEEN --registered--> RUNNING --prompt_done/ready--> READY --pull--> SENDING --the last write ends--> CLOSED
    SENDING --a write ends, more D requests to come (n > 1)--> READY
    READY --expiry passes, or every D request released it--> CLOSED (blocks freed)
    UNSEEN --unknown_wait passes--> CLOSED (ERROR: P never saw it)
    any phase but SENDING --cancelled--> CLOSED (a parked pull gets ERROR now)

`prompt_done` comes from the worker right after the forward that completed
the prompt, while P's scheduler still holds the request (it samples P's
one token next): the KV may be sent from then on, but the blocks belong
to the scheduler until `ready` (the request finished), so every Free of
a `held` entry waits for `ready`.

A CLOSED entry stays as a tombstone for `tombstone_s`, so a pull that
arrives after a cancel or an expiry is answered at once, not after a wait.

A transfer may be bound to its D (`bind`: the SHA-256 of a secret the proxy
gave only that D): a pull or release that does not carry the secret is
refused and changes nothing, whatever the phase; pulls that arrive before the
binding is known wait parked and are sifted when it comes.

D's side is pdkv.connector.pulls (`PullSpec`, `PullTracker`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Phase(StrEnum):
    UNSEEN = "unseen"  # D's pull arrived before P's scheduler registered the transfer
    RUNNING = "running"  # P's request is being prefilled
    READY = "ready"  # P's request finished with its prompt computed; blocks held for D
    SENDING = "sending"
    CLOSED = "closed"


@dataclass(frozen=True)
class StartSend:
    """Write P's `blocks` to the parked `pull`'s destination."""

    transfer_id: str
    p_req_id: str
    blocks: list[int]
    pull: Any


@dataclass(frozen=True)
class Reply:
    """Answer `pull` with an error (a DONE reply comes from the send itself)."""

    transfer_id: str
    pull: Any
    error: str


@dataclass(frozen=True)
class Free:
    """Report P's request as finished sending, so the scheduler frees its blocks."""

    transfer_id: str
    p_req_id: str
    outcome: str  # "sent", "failed", "expired", "released", "duplicate" (a transfer_id used up before)


Action = StartSend | Reply | Free


@dataclass
class SendEntry:
    transfer_id: str
    phase: Phase
    p_req_id: str = ""
    blocks: list[int] | None = None
    pulls: list[Any] = field(default_factory=list)  # parked: waiting for the blocks (or for registration)
    deadline: float | None = None  # UNSEEN: give up; READY: expire; CLOSED: forget
    expected: int = 1  # D requests that pull this transfer (n > 1: one per choice)
    ranks: int = 1  # pulls each D request makes here: D ranks sharing this P rank's heads (D's TP larger than P's)
    served: int = 0  # of those, how many are done with it: sent, failed, or released by D
    sending: dict[str, Any] = field(default_factory=dict)  # D request id -> its pull, whose write is in flight
    failed: bool = False  # a write of this transfer failed
    outcome: str = ""
    held: bool = False  # computed, not yet finished: P's scheduler still owns the blocks
    free_due: str = ""  # the outcome of a Free that waits for `ready`

    @property
    def wanted(self) -> int:
        """Pulls this transfer serves in all: each D request's, from each D rank that takes heads here."""
        return self.expected * self.ranks

    @property
    def claimed(self) -> int:
        """Pulls this transfer has taken: served, in flight, or parked."""
        return self.served + len(self.sending) + len(self.pulls)


@dataclass
class SendLimits:
    unknown_wait_s: float = 120.0  # how long a pull waits for a transfer_id P has not seen
    expiry_s: float = 120.0  # how long finished blocks wait for D's pull
    tombstone_s: float = 300.0  # how long a closed transfer's outcome is remembered
    max_fanout: int = 128  # most D requests one transfer may serve (the proxy's `n`)


class SendTable:
    """P's transfers. Every method returns the actions the caller must perform, in order.

    A transfer serves `expected` pulls (one per D request: `n` choices are
    `n` D requests sharing one prefill), each from `ranks` D ranks where D's TP
    is larger than P's; it closes, and its blocks are
    freed, once every one of them has been sent, failed or released, or
    when it expires waiting for the rest.
    """

    def __init__(self, limits: SendLimits | None = None) -> None:
        self.limits = limits or SendLimits()
        self.entries: dict[str, SendEntry] = {}
        self.bindings: dict[str, str] = {}  # transfer_id -> commitment to its D's binding secret; dropped with the entry
        self.fanouts: dict[str, int] = {}  # transfer_id -> D requests it serves (n > 1), until `registered` says so too

    def expect(self, transfer_id: str, pulls: int) -> None:
        """`transfer_id` serves `pulls` D requests (n > 1). Said on the model runner's thread before the forward (the
        thread `prompt_done` comes from), so that a prompt computed (and pulled) before `registered` reaches the table
        already takes every choice's pull and waits for every one of them before its blocks are freed."""
        if pulls <= 1:
            return
        self.fanouts[transfer_id] = pulls
        e = self.entries.get(transfer_id)
        if e is not None and e.phase is not Phase.CLOSED:
            e.expected = pulls

    def bind(self, transfer_id: str, commitment: str) -> None:
        """Only a pull (or release) carrying the secret whose SHA-256 is `commitment` may take `transfer_id`."""
        if commitment:
            self.bindings[transfer_id] = commitment

    def _bound_ok(self, transfer_id: str, pull: Any) -> bool | None:
        """True/False: `pull` does/does not prove the binding; None: nothing to prove against yet (or ever)."""
        commitment = self.bindings.get(transfer_id)
        if commitment is None:
            return None
        from pdkv.auth import binding_matches

        return binding_matches(_binding_of(pull), commitment)

    def _sift(self, e: SendEntry) -> list[Action]:
        """Refuse the parked pulls of `e` that do not prove its binding; the rest stay parked."""
        if e.transfer_id not in self.bindings:
            return []
        kept, refused = [], []
        for x in e.pulls:
            (kept if self._bound_ok(e.transfer_id, x) else refused).append(x)
        e.pulls = kept
        return [Reply(e.transfer_id, x, _NOT_BOUND) for x in refused]

    def _close(self, e: SendEntry, now: float, outcome: str) -> None:
        e.phase = Phase.CLOSED
        e.outcome = outcome
        e.pulls = []
        e.deadline = now + self.limits.tombstone_s

    def _entry(self, transfer_id: str, phase: Phase = Phase.RUNNING, **fields: Any) -> SendEntry:
        """`transfer_id`'s entry, made with `phase` and `fields` if it has none (its choices as `expect` said)."""
        e = self.entries.get(transfer_id)
        if e is None:
            fields.setdefault("expected", self.fanouts.get(transfer_id, 1))
            e = self.entries[transfer_id] = SendEntry(transfer_id, phase, **fields)
        return e

    def registered(self, transfer_id: str, p_req_id: str, now: float, pulls: int = 1) -> list[Action]:
        """P's scheduler allocated blocks for the request that will produce `transfer_id`, for `pulls` D requests."""
        self.fanouts.pop(transfer_id, None)
        e = self.entries.get(transfer_id)
        if e is None:
            self.entries[transfer_id] = SendEntry(transfer_id, Phase.RUNNING, p_req_id=p_req_id, expected=pulls)
            return []
        if e.phase is not Phase.UNSEEN:
            if e.phase is not Phase.CLOSED and e.p_req_id == p_req_id:
                e.expected = pulls  # `prompt_done` came first (it runs on the model runner's thread)
            return []
        e.phase, e.p_req_id, e.deadline, e.expected = Phase.RUNNING, p_req_id, None, pulls
        refused = self._sift(e)
        extra, e.pulls = e.pulls[e.wanted:], e.pulls[: e.wanted]
        return refused + [Reply(transfer_id, x, f"transfer {transfer_id} serves {pulls} pull(s) and already has them") for x in extra]

    def _free(self, e: SendEntry, outcome: str) -> list[Action]:
        """Free `e`'s blocks now, or once P's request finishes if the scheduler still holds it."""
        if e.held:
            e.free_due = outcome
            return []
        return [Free(e.transfer_id, e.p_req_id, outcome)]

    def _blocks_here(self, e: SendEntry, now: float) -> list[Action]:
        """`e`'s blocks can be sent from now on: start every parked pull, or wait in READY for them."""
        if e.served >= e.wanted and not e.sending:
            self._close(e, now, "released")
            return self._free(e, "released")
        refused = self._sift(e)
        starts: list[Action] = refused + [StartSend(e.transfer_id, e.p_req_id, e.blocks or [], x) for x in e.pulls]
        e.sending.update((_pull_id(x, i), x) for i, x in enumerate(e.pulls))
        e.pulls = []
        e.phase = Phase.SENDING if e.sending else Phase.READY
        # No expiry while held (the clock starts at `ready`) or while writes run.
        e.deadline = now + self.limits.expiry_s if e.phase is Phase.READY and not e.held else None
        return starts

    def prompt_done(self, transfer_id: str, p_req_id: str, blocks: list[int], now: float) -> list[Action]:
        """The forward that completed P's prompt ran: its KV in `blocks` may be sent before the request finishes."""
        e = self._entry(transfer_id, Phase.RUNNING, p_req_id=p_req_id)
        if e.phase not in (Phase.UNSEEN, Phase.RUNNING):
            return []  # a repeat, or an id already used by another request: `ready` settles it
        e.p_req_id, e.blocks, e.held = p_req_id, list(blocks), True
        return self._blocks_here(e, now)

    def ready(self, transfer_id: str, p_req_id: str, blocks: list[int], now: float) -> list[Action]:
        """P's request finished with its prompt computed; its `blocks` are held until a Free."""
        e = self._entry(transfer_id)
        if e.held and e.p_req_id == p_req_id:
            # Computed earlier: the sends may be done, running or waiting for D.
            e.held = False
            if e.free_due:
                outcome, e.free_due = e.free_due, ""
                return [Free(transfer_id, p_req_id, outcome)]
            if e.phase is Phase.READY:
                e.deadline = now + self.limits.expiry_s
            return []
        if e.phase in (Phase.SENDING, Phase.READY) or (e.phase is Phase.CLOSED and e.p_req_id == p_req_id):
            return []  # a repeat of what we already hold
        if e.phase is Phase.CLOSED:
            # The transfer_id was used up (or given up) before: release these blocks at once.
            return [Free(transfer_id, p_req_id, "duplicate")]
        e.p_req_id, e.blocks = p_req_id, list(blocks)
        return self._blocks_here(e, now)

    def cancelled(self, transfer_id: str, reason: str, now: float) -> list[Action]:
        """P's request ended without KV to send (aborted, failed, prompt not computed)."""
        e = self._entry(transfer_id)
        if e.phase in (Phase.SENDING, Phase.CLOSED):
            return []
        e.held, e.free_due = False, ""  # the scheduler frees these blocks itself
        actions: list[Action] = [Reply(transfer_id, x, f"prefill request ended without KV: {reason}") for x in e.pulls]
        self._close(e, now, f"cancelled: {reason}")
        return actions

    def pull(self, transfer_id: str, pull: Any, now: float, ranks: int = 1) -> list[Action]:
        """D asked for the KV of `transfer_id` (`pull` names its D request, see _d_req_id); `ranks`: how many D
        ranks of that request pull here (D's TP larger than P's), each its own share of the heads."""
        if self._bound_ok(transfer_id, pull) is False:
            return [Reply(transfer_id, pull, _NOT_BOUND)]
        e = self.entries.get(transfer_id)
        if e is None:
            self._entry(transfer_id, Phase.UNSEEN, pulls=[pull], deadline=now + self.limits.unknown_wait_s, ranks=ranks)
            return []
        if e.phase is Phase.CLOSED:
            why = "already sent" if e.outcome == "sent" else e.outcome
            return [Reply(transfer_id, pull, f"transfer {transfer_id} is closed ({why})")]
        e.ranks = max(e.ranks, ranks)
        # Before registration the number of D requests is not known yet: park up to the bound.
        limit = self.limits.max_fanout * e.ranks if e.phase is Phase.UNSEEN else e.wanted
        who = _pull_id(pull, e.claimed)
        # Parked pulls not yet sifted: one with another secret does not make this one a repeat.
        if e.claimed >= limit or who in e.sending or any(_pull_id(x, -1) == who and _binding_of(x) == _binding_of(pull) for x in e.pulls):
            return [Reply(transfer_id, pull, f"transfer {transfer_id} already has a pull in progress")]
        if e.phase in (Phase.READY, Phase.SENDING):
            e.phase, e.deadline = Phase.SENDING, None
            e.sending[who] = pull
            assert e.blocks is not None
            return [StartSend(transfer_id, e.p_req_id, e.blocks, pull)]
        e.pulls.append(pull)
        return []

    def released(self, transfer_id: str, now: float, d_req_id: str = "", proof: Any = None) -> list[Action]:
        """D request `d_req_id` no longer wants the KV (it ended first, or found the prompt cached; or the proxy
        says no D request will pull it). `proof`: the release as sent, checked against the binding like a pull."""
        if proof is not None and self._bound_ok(transfer_id, proof) is False:
            return []
        # Before P saw it: remembered as a tombstone (bounded), so its blocks are freed once they come.
        e = self._entry(transfer_id, Phase.UNSEEN, deadline=now + self.limits.unknown_wait_s)
        if e.phase is Phase.CLOSED or (d_req_id and d_req_id in e.sending):
            return []  # nothing left, or the write in flight settles it
        e.served += 1
        actions: list[Action] = []
        mine = [x for x in e.pulls if _d_req_id(x) == d_req_id] if d_req_id else e.pulls[:1]
        for x in mine:
            e.pulls.remove(x)
            actions.append(Reply(transfer_id, x, "released by the decode side"))
        if e.phase is Phase.UNSEEN and e.served >= e.wanted:
            self._close(e, now, "released")
        elif e.phase is Phase.READY and e.served >= e.wanted:
            self._close(e, now, "released")
            actions.extend(self._free(e, "released"))
        return actions

    def send_finished(self, transfer_id: str, error: str | None, now: float, d_req_id: str = "") -> list[Action]:
        """The write started by StartSend (to D request `d_req_id`) ended (error None: every byte landed)."""
        e = self.entries.get(transfer_id)
        if e is None or e.phase is not Phase.SENDING:
            return []
        if d_req_id in e.sending:
            del e.sending[d_req_id]
        elif e.sending:
            e.sending.popitem()
        e.served += 1
        e.failed = e.failed or error is not None
        if e.sending:
            return []
        if e.served < e.wanted:
            e.phase = Phase.READY  # more D requests (or D ranks) to come
            e.deadline = None if e.held else now + self.limits.expiry_s
            return []
        outcome = "failed" if e.failed else "sent"
        self._close(e, now, outcome if error is None else f"failed: {error}")
        return self._free(e, outcome)

    def tick(self, now: float) -> list[Action]:
        """Apply every deadline that has passed."""
        actions: list[Action] = []
        for tid, e in list(self.entries.items()):
            if e.deadline is None or e.deadline > now:
                continue
            if e.phase is Phase.UNSEEN:
                actions.extend(
                    Reply(tid, x, f"prefill side never saw transfer {tid} within {self.limits.unknown_wait_s:g} s") for x in e.pulls
                )
                self._close(e, now, "unknown")
            elif e.phase is Phase.READY:
                outcome = "expired" if not e.served else ("failed" if e.failed else "sent")
                self._close(e, now, "expired")
                actions.extend(self._free(e, outcome))
            elif e.phase is Phase.CLOSED and not e.held:
                del self.entries[tid]
                self.bindings.pop(tid, None)
                self.fanouts.pop(tid, None)
        return actions

    def parked_pulls(self) -> list[tuple[str, Any, float | None]]:
        """(transfer_id, pull, deadline) of every pull still waiting on P (parked or being written), for heartbeats."""
        return [(t, x, e.deadline) for t, e in self.entries.items() for x in (*e.pulls, *e.sending.values())]

    def holding(self) -> int:
        """How many transfers hold P's blocks right now."""
        return sum(1 for e in self.entries.values() if e.phase in (Phase.READY, Phase.SENDING))


_NOT_BOUND = "this pull does not carry the transfer's binding: only the decode engine the proxy chose may take it"


def _binding_of(msg: Any) -> str:
    """The binding secret a parked pull (its request) or a release carries; "" for none."""
    request = getattr(msg, "request", msg)
    return str(getattr(request, "binding", "") or "")


def pull_key(d_req_id: str, d_rank: int = 0, d_tp: int = 1, p_tp: int = 1) -> str:
    """The table's name for D rank `d_rank`'s pull for D request `d_req_id`: the request's id, and the rank too
    when D's TP is larger than P's (several D ranks of one request then pull one P rank)."""
    return f"{d_req_id}#tp{d_rank}" if d_tp > p_tp else d_req_id


def _d_req_id(pull: Any) -> str:
    """The D request (and rank, see pull_key) a parked pull came from: the sender parks pulls with a `key`; tests
    may park plain tokens."""
    key = getattr(pull, "key", None)
    if key:
        return str(key)
    request = getattr(pull, "request", None)
    return str(getattr(request, "d_req_id", "") or "")


def _pull_id(pull: Any, index: int) -> str:
    return _d_req_id(pull) or f"#{index}"

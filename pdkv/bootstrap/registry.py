"""The bootstrap registry: which prefill engine holds each DP rank, and where its workers listen.

Pure state and rules, no I/O. The server wraps it; liveness probing (an I/O
matter) is the server's, and reaches the registry only as "this holder is
dead, evict it" (`register(..., evict=conflict)`) or as probe results
(`record_probe`).

Rules, the same as vLLM's MooncakeBootstrapServer plus eviction:
- a DP rank belongs to one engine_id; a (dp, tp, pp) to one address;
- an identical re-registration changes nothing and succeeds;
- anything else that disagrees with the current holder is a `Conflict`,
  refused unless the caller evicts that exact holder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from pdkv.errors import RegistryConflict
from pdkv.wire import EngineEntry, EngineId, RegisterRequest, WorkerAddr


class Outcome(StrEnum):
    CREATED = "created"
    UNCHANGED = "unchanged"
    REPLACED = "replaced"


class ConflictKind(StrEnum):
    ENGINE = "engine_id"  # another engine holds this dp_rank
    ADDR = "addr"  # this (dp, tp, pp) is registered at another address


class Conflict(msgspec.Struct, frozen=True):
    """Why a registration disagrees with the registry, and whom it disagrees with.

    `holder_addrs` are the addresses that must all be dead before the holder
    may be evicted: every address of the holding engine for ENGINE, the one
    old address for ADDR.
    """

    kind: ConflictKind
    dp_rank: int
    holder: EngineId
    holder_addrs: tuple[WorkerAddr, ...]
    message: str


@dataclass
class _Engine:
    engine_id: EngineId
    workers: dict[tuple[int, int], WorkerAddr] = field(default_factory=dict)  # (tp, pp) -> addr
    failed_probes: int = 0


def _describe(addrs: tuple[WorkerAddr, ...]) -> str:
    return ", ".join(addrs) if addrs else "no workers yet"


class BootstrapRegistry:
    """Engine entries keyed by DP rank. Not thread-safe: one event loop owns it."""

    def __init__(self) -> None:
        self._engines: dict[int, _Engine] = {}
        self.version = 0  # bumped on every change, so a server can cache its /query bytes

    # --- reading ------------------------------------------------------------

    @property
    def engine_count(self) -> int:
        return len(self._engines)

    @property
    def worker_count(self) -> int:
        return sum(len(e.workers) for e in self._engines.values())

    def query(self) -> dict[str, EngineEntry]:
        """The GET /query document: {"<dp>": EngineEntry}, ranks in numeric order."""
        out: dict[str, EngineEntry] = {}
        for dp in sorted(self._engines):
            engine = self._engines[dp]
            worker_addr: dict[str, dict[str, WorkerAddr]] = {}
            for (tp, pp), addr in sorted(engine.workers.items()):
                worker_addr.setdefault(str(tp), {})[str(pp)] = addr
            out[str(dp)] = EngineEntry(engine_id=engine.engine_id, worker_addr=worker_addr)
        return out

    def holders(self) -> list[tuple[int, EngineId, tuple[WorkerAddr, ...]]]:
        """(dp_rank, engine_id, addresses) of every entry: what a liveness sweep probes."""
        return [(dp, e.engine_id, tuple(sorted(set(e.workers.values())))) for dp, e in sorted(self._engines.items())]

    # --- rules --------------------------------------------------------------

    def check(self, req: RegisterRequest) -> Conflict | None:
        """The conflict `req` would meet now, or None if `register(req)` would succeed."""
        engine = self._engines.get(req.dp_rank)
        if engine is None:
            return None
        if engine.engine_id != req.engine_id:
            addrs = tuple(sorted(set(engine.workers.values())))
            return Conflict(
                kind=ConflictKind.ENGINE,
                dp_rank=req.dp_rank,
                holder=engine.engine_id,
                holder_addrs=addrs,
                message=(
                    f"dp_rank={req.dp_rank} is held by engine {engine.engine_id!r} ({_describe(addrs)}); "
                    f"refusing engine {req.engine_id!r} at {req.addr}"
                ),
            )
        existing = engine.workers.get((req.tp_rank, req.pp_rank))
        if existing is not None and existing != req.addr:
            return Conflict(
                kind=ConflictKind.ADDR,
                dp_rank=req.dp_rank,
                holder=engine.engine_id,
                holder_addrs=(existing,),
                message=(
                    f"dp_rank={req.dp_rank} tp_rank={req.tp_rank} pp_rank={req.pp_rank} of engine "
                    f"{engine.engine_id!r} is registered at {existing}; refusing {req.addr}"
                ),
            )
        return None

    def register(self, req: RegisterRequest, *, evict: Conflict | None = None) -> Outcome:
        """Record `req`. Raises RegistryConflict (status 409) on a conflict, unless
        `evict` is exactly the conflict met now: then the holder is replaced.

        Re-checking here (not trusting an earlier `check`) keeps the rules
        intact when other registrations landed while the caller probed.
        """
        conflict = self.check(req)
        if conflict is not None and conflict != evict:
            raise RegistryConflict(conflict.message, status=409)
        engine = self._engines.get(req.dp_rank)
        if conflict is not None and conflict.kind is ConflictKind.ENGINE:
            engine = None  # the dead holder's whole entry goes
        if engine is None:
            self._engines[req.dp_rank] = _Engine(req.engine_id, {(req.tp_rank, req.pp_rank): req.addr})
            self.version += 1
            return Outcome.REPLACED if conflict is not None else Outcome.CREATED
        engine.failed_probes = 0
        key = (req.tp_rank, req.pp_rank)
        if engine.workers.get(key) == req.addr:
            return Outcome.UNCHANGED
        engine.workers[key] = req.addr
        self.version += 1
        return Outcome.REPLACED if conflict is not None else Outcome.CREATED

    def deregister(self, engine_id: EngineId) -> int:
        """Remove every entry of `engine_id`; returns how many worker addresses went (0 if none)."""
        removed = 0
        for dp in [dp for dp, e in self._engines.items() if e.engine_id == engine_id]:
            removed += len(self._engines.pop(dp).workers)
        if removed:  # an entry always holds at least one worker
            self.version += 1
        return removed

    def record_probe(self, dp_rank: int, engine_id: EngineId, *, alive: bool, max_failures: int) -> bool:
        """Count one liveness probe of the engine at `dp_rank`; drop it after
        `max_failures` failures in a row. Returns True if it was dropped.

        A probe result for an engine that no longer holds `dp_rank` (replaced
        while the probe ran) is ignored.
        """
        engine = self._engines.get(dp_rank)
        if engine is None or engine.engine_id != engine_id:
            return False
        if alive:
            engine.failed_probes = 0
            return False
        engine.failed_probes += 1
        if engine.failed_probes < max_failures:
            return False
        del self._engines[dp_rank]
        self.version += 1
        return True

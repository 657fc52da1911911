"""The parts `pdkv up` supervises, as its console shows them: state, pid, uptime, restarts, log."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from pdkv.deploy import Supervisor


class PartRow(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    state: str  # waiting, starting, ready, restarting, failed, exited, stopped
    url: str
    pid: int | None
    uptime_s: float | None  # since its process started
    restarts: int
    log: str


def part_rows(sup: Supervisor, now: float | None = None) -> list[PartRow]:
    """One row per part. Reads the supervisor's state without its owner's help: each value read is one
    dict or attribute lookup, so a row is at worst one change behind."""
    now = time.monotonic() if now is None else now
    rows = []
    for proc, policy in zip(list(sup.procs), list(sup.policies)):
        state = sup.states.get(proc.name, "waiting")
        started = proc.started_at
        alive = state in ("starting", "ready") and started is not None
        rows.append(PartRow(name=proc.name, state=state, url=proc.url, pid=proc.pid if alive else None,
                            uptime_s=round(now - started, 1) if alive and started is not None else None,
                            restarts=policy.restarts, log=str(proc.log_path)))  # fmt: skip
    return rows

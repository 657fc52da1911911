"""Supervising every process of a deployment: start in order, each healthy before the next; stop in reverse."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from pdkv.errors import StartError
from pdkv.launch import LaunchPlan, ManagedProcess

log = logging.getLogger("pdkv.deploy")


class Supervisor:
    """Start several plans in order, stage by stage; stop them all in reverse.

    `stages` gives each plan a stage number (default: one stage per plan, so
    each is healthy before the next starts). Plans of one stage start together
    and the next stage starts once all of them are healthy. `on_line(name, line)`
    receives every output line; `on_change()` runs after any state change (for
    a live view). `states` maps each name to one of waiting, starting, ready,
    failed, exited, stopped.
    """

    def __init__(
        self,
        plans: list[LaunchPlan],
        log_dir: str | Path,
        *,
        on_line: Callable[[str, str], None] | None = None,
        on_change: Callable[[], None] | None = None,
        stages: list[int] | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.stages = stages if stages is not None else list(range(len(plans)))
        if len(self.stages) != len(plans):
            raise ValueError("one stage per plan")
        self.on_change = on_change or (lambda: None)
        self.procs = [
            ManagedProcess(plan, self.log_dir / f"{plan.name}.log", on_line=(lambda line, n=plan.name: on_line(n, line)) if on_line else None)
            for plan in plans
        ]
        self.states: dict[str, str] = {plan.name: "waiting" for plan in plans}
        self.ready_s: dict[str, float] = {}

    def _set(self, name: str, state: str) -> None:
        self.states[name] = state
        try:
            self.on_change()
        except Exception:  # a display error must never stop supervision (or a shutdown) half-way
            log.exception("status view update failed")

    def start_all(self, timeout: float, *, interval: float = 0.5) -> float:
        """Start every part, stage by stage, and wait for each to be healthy; return seconds until all were.

        Raises StartError when one dies or is not healthy within `timeout`;
        the parts already started keep running until `stop_all`.
        """
        t0 = time.monotonic()
        for stage in sorted(set(self.stages)):
            group = [p for p, s in zip(self.procs, self.stages, strict=True) if s == stage]
            for proc in group:
                self._set(proc.name, "starting")
                proc.start()
            deadline = time.monotonic() + timeout
            waiting = list(group)
            while waiting:
                for proc in list(waiting):
                    try:
                        healthy = proc.probe(deadline)
                    except StartError:
                        self._set(proc.name, "failed")
                        raise
                    if healthy:
                        waiting.remove(proc)
                        self.ready_s[proc.name] = time.monotonic() - t0
                        self._set(proc.name, "ready")
                if waiting:
                    time.sleep(interval)
        return time.monotonic() - t0

    def wait_for_exit(self, interval: float = 0.5) -> ManagedProcess:
        """Block until some part exits; return it (Ctrl-C interrupts the wait)."""
        while True:
            for proc in self.procs:
                if proc.proc is not None and proc.poll() is not None:
                    self._set(proc.name, "exited")
                    return proc
            time.sleep(interval)

    def stop_all(self, grace: float = 10.0) -> None:
        """Stop every started part, last started first (the proxy before the engines it routes to).

        Every part is stopped even when stopping another raised; the first error is re-raised after.
        """
        first_error: BaseException | None = None
        for proc in reversed(self.procs):
            if proc.proc is None:
                continue
            try:
                proc.stop(grace)
            except BaseException as exc:  # keep going: an orphaned engine would hold its cores and ports
                first_error = first_error or exc
                continue
            if self.states.get(proc.name) not in ("failed", "exited"):
                self._set(proc.name, "stopped")
        if first_error is not None:
            raise first_error

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

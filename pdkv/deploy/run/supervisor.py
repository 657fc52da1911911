"""Supervising every process of a deployment: start in order, each healthy before the next; restart
what dies (by each part's `RestartPolicy`); stop in reverse."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

from pdkv.deploy.plan import Launch
from pdkv.deploy.run.process import ManagedProcess
from pdkv.deploy.run.restart import RestartPolicy, Verdict, describe_exit
from pdkv.errors import StartError

log = logging.getLogger("pdkv.deploy")

EventKind = Literal["exited", "restarting", "restarted", "gave-up", "started"]
RUNNING = ("starting", "ready", "restarting")


class PartEvent(msgspec.Struct, frozen=True):
    """One thing the watch loop saw or did about one part; `message` says it in one line."""

    name: str
    kind: EventKind
    message: str
    code: int | None = None
    delay_s: float | None = None
    pid: int | None = None


def _last_line(proc: ManagedProcess) -> str:
    lines = [line for line in proc.log_tail(20).splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


class Supervisor:
    """Start several launches in order, stage by stage; restart the ones that die; stop them all in reverse.

    `stages` gives each launch a stage number (default: one stage per launch, so
    each is healthy before the next starts). Launches of one stage start together
    and the next stage starts once all of them are healthy. `restart` gives
    each launch its RestartPolicy (default: "no" for every launch).
    `restart_with` names, for a part, the parts that must start again once it
    is back (a standalone bootstrap forgets who registered: its prefill must
    register again). `on_line(name, line)` receives every output line;
    `on_change()` runs after any state change (for a live view); `on_event`
    receives each PartEvent of `watch`. `states` maps each name to one of
    waiting, starting, ready, restarting, failed, exited, stopped.
    """

    def __init__(
        self,
        launches: list[Launch],
        log_dir: str | Path,
        *,
        on_line: Callable[[str, str], None] | None = None,
        on_change: Callable[[], None] | None = None,
        on_event: Callable[[PartEvent], None] | None = None,
        stages: list[int] | None = None,
        restart: list[RestartPolicy] | None = None,
        restart_with: dict[str, list[str]] | None = None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.stages = stages if stages is not None else list(range(len(launches)))
        self.policies = restart if restart is not None else [RestartPolicy("no") for _ in launches]
        if len(self.stages) != len(launches) or len(self.policies) != len(launches):
            raise ValueError("one stage and one restart policy per launch")
        self.restart_with = restart_with or {}
        self.on_change = on_change or (lambda: None)
        self.on_event = on_event or (lambda _e: None)
        self._on_line = on_line
        self.procs = [
            ManagedProcess(launch, self.log_dir / f"{launch.name}.log",
                           on_line=(lambda line, n=launch.name: on_line(n, line)) if on_line else None)
            for launch in launches
        ]
        # Owned by the thread that calls start_all/watch/stop_all (one at a time).
        self.states: dict[str, str] = {launch.name: "waiting" for launch in launches}
        self.ready_s: dict[str, float] = {}
        self._due: dict[str, float] = {}  # restarting part -> when it starts again (time.monotonic())
        self._deadline: dict[str, float] = {}  # restarted part, not healthy yet -> when it has failed
        self._start_timeout = 900.0
        self._added: set[str] = set()  # started by `launch` and not healthy yet: reported "started", not "restarted"
        self._launched: dict[str, Callable[[ManagedProcess, str], None]] = {}  # started by `launch` -> who hears of its failure
        self.grace = 10.0  # seconds a part has to stop on SIGTERM before SIGKILL

    def _set(self, name: str, state: str) -> None:
        self.states[name] = state
        try:
            self.on_change()
        except Exception:  # a display error must never stop supervision (or a shutdown) half-way
            log.exception("status view update failed")

    def _emit(self, event: PartEvent) -> None:
        log.info("%s: %s", event.name, event.message)
        try:
            self.on_event(event)
        except Exception:  # as for on_change: reporting must not stop supervision
            log.exception("event report failed")

    def start_all(self, timeout: float, *, interval: float = 0.5) -> float:
        """Start every part, stage by stage, and wait for each to be healthy; return seconds until all were.

        Raises StartError when one dies or is not healthy within `timeout`;
        the parts already started keep running until `stop_all`. `timeout`
        also bounds each restart of `watch`.
        """
        self._start_timeout = timeout
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

    def launch(self, launch: Launch, *, stage: int, on_failure: Callable[[ManagedProcess, str], None]) -> None:
        """Start a part while the watch runs (an engine an autoscaler adds), or start a `retire`d one again with its
        launch. The part is its launcher's: the watch reports it "started" once healthy; when it is not healthy within
        the start timeout or exits, the watch reports it "exited", stops what is left of its process group, sets it
        "failed" and calls `on_failure(process, how)`. It is never restarted here and never ends the watch, whatever
        the restart policies of the parts `start_all` started. StartError (the part "failed") when its process
        cannot be started at all. From the watching thread."""
        proc = next((p for p in self.procs if p.name == launch.name), None)
        if proc is None:
            log_path = self.log_dir / f"{launch.name}.log"
            proc = ManagedProcess(launch, log_path, on_line=(lambda line, n=launch.name: self._on_line(n, line)) if self._on_line else None)
            self.procs.append(proc)
            self.stages.append(stage)
            self.policies.append(RestartPolicy("no"))  # never asked: a launched part's failure goes to on_failure
        elif self.states[launch.name] in RUNNING:
            raise ValueError(f"{launch.name} is running already")
        self._launched[launch.name] = on_failure
        self._set(launch.name, "starting")
        self._added.add(launch.name)
        try:
            proc.start()
        except StartError:
            self._set(launch.name, "failed")
            raise
        self._deadline[launch.name] = time.monotonic() + self._start_timeout

    def retire(self, name: str, grace: float | None = None) -> int | None:
        """Stop one part for good (an autoscaler's scale-down; its requests drained first): no restart. Its exit code."""
        proc = next(p for p in self.procs if p.name == name)
        self._deadline.pop(name, None)
        self._due.pop(name, None)
        self._added.discard(name)
        code = proc.stop(self.grace if grace is None else grace)
        self._set(name, "stopped")
        return code

    def watch(self, *, interval: float = 0.5, until: Callable[[], bool] | None = None,
              every: Callable[[], None] | None = None) -> ManagedProcess | None:
        """Keep the started parts running; return when one's exit ends the deployment (Ctrl-C interrupts it).

        Each exit is reported (`on_event`, with the exit code or signal and the
        log's last line) and handed to that part's policy. A restart keeps the
        part's launch: its ports, cores and environment. A part past its restart
        bound stays "failed" while the others keep serving. Returns the part
        whose exit its policy does not restart (restart "no"), the
        last part to fail when none is left running, or None once `until()`
        is true (checked every `interval` s). `every()` runs once per round, on this thread (an autoscaler's
        tick: it may `launch` and `retire` parts).
        """
        last_failed: ManagedProcess | None = None
        while until is None or not until():
            if every is not None:
                try:
                    every()
                except Exception:  # an autoscaler's error must not stop supervision
                    log.exception("watch hook failed")
            for proc in self.procs:
                state = self.states[proc.name]
                if state == "ready" and proc.poll() is not None:
                    done = self._failed(proc, proc.poll(), describe_exit(proc.poll()))
                elif state == "restarting" and time.monotonic() >= self._due[proc.name]:
                    done = self._restart(proc)
                elif state == "starting" and proc.name in self._deadline:
                    done = self._check_restarted(proc)
                else:
                    continue
                if done == "stop":
                    return proc
                if done == "failed":
                    last_failed = proc
            if not any(s in RUNNING for s in self.states.values()):
                return last_failed
            time.sleep(interval)
        return None

    def _failed(self, proc: ManagedProcess, code: int | None, how: str) -> str:
        """Report one failure of `proc`, ask its policy (or hand it to its launcher), and set its state; 'stop',
        'failed', 'restarting' or 'handed-over'."""
        if proc.name in self._launched:
            return self._hand_over(proc, code, how)
        policy = self.policies[self.procs.index(proc)]
        decision = policy.exited(time.monotonic(), code) if code is not None else policy.failed(time.monotonic(), how)
        last = _last_line(proc)
        message = f"{proc.name} {how}" + (f"; its log's last line: {last}" if last else "")
        self._emit(PartEvent(proc.name, "exited", message, code=code, pid=proc.pid))
        self._deadline.pop(proc.name, None)
        if decision.verdict is Verdict.RESTART:
            self._due[proc.name] = time.monotonic() + decision.delay_s
            self._set(proc.name, "restarting")
            self._emit(PartEvent(proc.name, "restarting", f"{proc.name} {decision.why}", code=code, delay_s=decision.delay_s))
            return "restarting"
        if decision.verdict is Verdict.GIVE_UP:
            self._set(proc.name, "failed")
            self._emit(PartEvent(proc.name, "gave-up", f"{proc.name} {decision.why}; read {proc.log_path}", code=code))
            return "failed"
        self._set(proc.name, "exited")
        return "stop"

    def _hand_over(self, proc: ManagedProcess, code: int | None, how: str) -> str:
        last = _last_line(proc)
        self._emit(PartEvent(proc.name, "exited", f"{proc.name} {how}" + (f"; its log's last line: {last}" if last else ""),
                             code=code, pid=proc.pid))
        self._deadline.pop(proc.name, None)
        self._added.discard(proc.name)
        try:
            proc.stop(self.grace)  # what is left of its group (an engine core) would hold its cores and ports
        finally:
            self._set(proc.name, "failed")
        try:
            self._launched[proc.name](proc, how)
        except Exception:  # the launcher's error must not stop supervision
            log.exception("failure report of %s failed", proc.name)
        return "handed-over"

    def _restart(self, proc: ManagedProcess) -> str:
        proc.stop(self.grace)  # what is left of its group (an orphaned engine core) would hold its cores and ports
        self._due.pop(proc.name, None)
        self._set(proc.name, "starting")
        try:
            proc.start()
        except StartError as exc:
            return self._failed(proc, None, exc.message.removeprefix(f"{proc.name}: "))
        self._deadline[proc.name] = time.monotonic() + self._start_timeout
        return "starting"

    def _check_restarted(self, proc: ManagedProcess) -> str:
        code = proc.poll()
        if code is not None:
            return self._failed(proc, code, describe_exit(code))
        deadline = self._deadline[proc.name]
        if proc.check_health(timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
            del self._deadline[proc.name]
            self._set(proc.name, "ready")
            if proc.name in self._added:
                self._added.discard(proc.name)
                self.ready_s[proc.name] = time.monotonic() - (proc.started_at or time.monotonic())
                self._emit(PartEvent(proc.name, "started", f"{proc.name} is healthy (pid {proc.pid}, {self.ready_s[proc.name]:.0f} s)",
                                     pid=proc.pid))
                return "ready"
            self._emit(PartEvent(proc.name, "restarted", f"{proc.name} is healthy again (pid {proc.pid})", pid=proc.pid))
            for name in self.restart_with.get(proc.name, []):
                self._restart_dependent(name, because=proc.name)
            return "ready"
        if time.monotonic() >= deadline:
            proc.stop(self.grace)
            began = "start" if proc.name in self._added else "restart"
            return self._failed(proc, None, f"was not healthy within {self._start_timeout:g} s of its {began}")
        return "starting"

    def _restart_dependent(self, name: str, *, because: str) -> None:
        proc = next(p for p in self.procs if p.name == name)
        if self.states[name] != "ready":
            return  # not running, or already on its way back
        self._due[name] = time.monotonic()
        self._set(name, "restarting")
        why = f"{name} starts again: {because} restarted and {name} must register with it again"
        self._emit(PartEvent(name, "restarting", why, pid=proc.pid))

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

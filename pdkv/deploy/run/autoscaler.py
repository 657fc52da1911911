"""`pdkv up -f` acting on the proxy's planner signal: engines started and stopped within `[autoscale]`'s bounds.

`Autoscaler.tick()` runs on the supervisor's watch thread (Supervisor.watch's
`every`). Every `interval_s` it reads the proxy's GET /pdkv/planner and, per
role, compares the desired count with the engines running or starting:

- more wanted (within max): a draining engine is taken back first (POST
  /pdkv/drain draining=false), then the lowest free slot starts
  (pdkv.deploy.plan.added_engines: the role's settings, the ports pdkv.deploy.plan.ports
  reserved for the slot, its own cores); it joins the proxy through the
  members registry once healthy;
- an added engine that cannot start, is not healthy in time or dies is that
  scale step failing, never the deployment's end: a "scale-failed" event with
  its log's last lines, the slot's parts stopped (the proxy routes it
  nothing new), the engines serving keep serving whatever the static parts'
  `restart`, and while the planner still asks the step is tried again after a
  backoff (pdkv.deploy.run.scale_policy.RetryBackoff: 10 s doubling to 300 s);
- fewer wanted (down to min): the newest engines drain: the proxy routes
  them nothing new (POST /pdkv/drain), their requests in flight finish, then
  they are stopped once the engine itself runs nothing either (its own
  /metrics); `drain_timeout_s` bounds the wait, also when the proxy or the
  engine stops answering (what is still in flight then is cut, and the event
  says how many); nothing but that engine is touched. An engine still
  starting has no request and stops at once; one that dies while draining is
  reported stopped, with its log's last lines.

Every step is a `ScaleEvent` to `on_event`. A proxy that does not answer
changes nothing (its engines keep serving); the next tick asks again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

from pdkv.deploy.plan import Deployment, Part, Role, added_entry, added_slot_parts, allocate_ports, parse_cores, with_vllm_logging
from pdkv.deploy.run.process import ManagedProcess
from pdkv.deploy.run.scale_policy import RetryBackoff, scale_steps
from pdkv.deploy.run.supervisor import RUNNING, Supervisor
from pdkv.engine_api import EngineClient
from pdkv.errors import PdkvError, RemoteError, StartError, UnreachableError
from pdkv.proxy_api import DrainAnswer, PlannerView, ProxyClient

log = logging.getLogger("pdkv.deploy")

ScaleKind = Literal["scale-up", "draining", "undrained", "stopped", "scale-failed"]
ROLES: tuple[Role, Role] = ("prefill", "decode")
LOG_LINES = 12  # of a failed engine's log, in its scale-failed event
STAGE = {"bootstrap": 0, "prefill": 1, "decode": 1}


class ScaleEvent(msgspec.Struct, frozen=True):
    """One scale step; `message` says it in one line."""

    kind: ScaleKind
    role: str
    name: str
    message: str
    desired: int
    active: int  # engines of the role running or starting after this step
    in_flight: int | None = None  # requests on a drained engine when it was stopped (cut when the drain timed out)
    log: list[str] = []  # the last lines of the log of the part that failed (scale-failed, or died while draining)


class Slot:
    """One engine of a role: its parts (a prefill's bootstrap, then the engine) and where it stands."""

    __slots__ = ("role", "index", "parts", "state", "drain_since")

    def __init__(self, role: Role, index: int, parts: list[Part], state: str = "active") -> None:
        self.role, self.index, self.parts = role, index, parts
        self.state = state  # active (running or starting) | draining | stopped
        self.drain_since = 0.0

    @property
    def engine(self) -> Part:
        return self.parts[-1]

    @property
    def url(self) -> str:
        return self.engine.launch.url


class Autoscaler:
    """The scale loop over one supervisor; every method runs on the watch thread."""

    def __init__(self, dep: Deployment, supervisor: Supervisor, parts: list[Part], proxy_url: str, log_dir: str | Path, *,
                 on_event: Callable[[ScaleEvent], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        assert dep.autoscale is not None
        self.dep, self.auto, self.sup = dep, dep.autoscale, supervisor
        self.proxy_url, self.log_dir = proxy_url.rstrip("/"), log_dir
        self.on_event = on_event or (lambda _e: None)
        self.clock = clock
        self.ports = allocate_ports(dep)  # the added slots' ports, reserved (and checked by pre-flight) before anything started
        self.slots: dict[Role, list[Slot]] = {}
        for role in ROLES:
            engines = [p for p in parts if p.kind == role]
            boots = {p.launch.name: p for p in parts if p.kind == "bootstrap"}
            self.slots[role] = [Slot(role, i, ([boots[f"bootstrap-{i}"]] if f"bootstrap-{i}" in boots else []) + [e])
                                for i, e in enumerate(engines)]
        self.desired: dict[str, int] | None = None
        self.view: PlannerView | None = None
        self._next_poll = 0.0
        self.backoff: dict[Role, RetryBackoff] = {role: RetryBackoff() for role in ROLES}
        self._client: ProxyClient | None = None

    # --- the loop
    def tick(self) -> None:
        now = self.clock()
        for slot in [s for role in ROLES for s in self.slots[role] if s.state == "draining"]:
            self._drain_step(slot, now)
        for role in ROLES:
            if any(s.state == "active" and s.index >= self._listed(role) and self.sup.states.get(s.engine.launch.name) == "ready"
                   for s in self.slots[role]):
                self.backoff[role].served()
        if now < self._next_poll:
            return
        self._next_poll = now + self.auto.interval_s
        try:
            view = self._proxy().planner()
        except (UnreachableError, RemoteError) as exc:  # the engines keep serving; the next tick asks again
            log.debug("autoscale: no planner view: %s", exc)
            return
        if view.desired is None:
            return
        self.view, self.desired = view, {"prefill": view.desired.prefill, "decode": view.desired.decode}
        for role in ROLES:
            self.apply(role, self.desired[role], now)

    def active(self, role: Role) -> list[Slot]:
        return [s for s in self.slots[role] if s.state == "active"]

    def apply(self, role: Role, desired: int, now: float) -> None:
        """Start or drain engines of `role` towards `desired` (within the role's bounds)."""
        bounds = self.auto.prefill if role == "prefill" else self.auto.decode
        step = scale_steps(desired, len(self.active(role)), (bounds.min, bounds.max))
        while step > 0:
            draining = [s for s in self.slots[role] if s.state == "draining"]
            if draining:
                self._undrain(max(draining, key=lambda s: s.index), desired)
            elif not self.backoff[role].due(now) or not self._start(role, desired, now):
                return
            step -= 1
        # The newest first; slot 0 never (a prefill's slot 0 holds the members registry the others join).
        for slot in sorted(self.active(role), key=lambda s: -s.index)[: max(0, -step)]:
            if slot.index > 0:
                self._drain(slot, desired, now)

    # --- scale up
    def _listed(self, role: Role) -> int:
        return len(self.dep.prefill if role == "prefill" else self.dep.decode)

    def _start(self, role: Role, desired: int, now: float) -> bool:
        stopped = [s for s in self.slots[role] if s.state == "stopped"]
        try:
            slot = min(stopped, key=lambda s: s.index) if stopped else self._new_slot(role)
        except PdkvError as exc:
            delay = self.backoff[role].failed(now)
            self._emit("scale-failed", role, f"{role}-{len(self.slots[role])}",
                       f"cannot add a {role} engine: {exc.message}; trying again in {delay:g} s", desired)
            return False
        slot.state = "active"
        for part in slot.parts:
            if self.sup.states.get(part.launch.name) not in RUNNING:
                try:
                    self.sup.launch(part.launch, stage=STAGE[part.kind], on_failure=self._part_failed)
                except StartError as exc:
                    self._step_failed(slot, part.launch.name, exc.message, [])
                    return False
        self._post_drain(slot.url, False)  # a slot started again: the proxy may still hold it as draining
        cores = f" on cores {slot.engine.spec.omp_bind}" if slot.engine.spec and slot.engine.spec.omp_bind else ""
        self._emit("scale-up", role, slot.engine.launch.name, f"starting {slot.engine.launch.name} at {slot.url}{cores}: the planner "
                   f"asks for {desired} {role} engine(s)", desired)  # fmt: skip
        return True

    def _new_slot(self, role: Role) -> Slot:
        slots = self.slots[role]
        index = len(slots)
        busy: dict[int, int] = {}
        for s in (s for r in ROLES for s in self.slots[r] if s.state != "stopped"):
            for core in parse_cores(s.engine.spec.omp_bind if s.engine.spec else None) or ():
                busy[core] = busy.get(core, 0) + 1
        entry = added_entry(self.dep, role, index - self._listed(role), busy)
        slot = Slot(role, index, with_vllm_logging(added_slot_parts(self.dep, self.ports, role, index, entry), self.log_dir))
        slots.append(slot)
        return slot

    # --- an added engine that fails
    def _part_failed(self, proc: ManagedProcess, how: str) -> None:
        """The supervisor's word that a launched part of a slot failed to start or died (on the watch thread)."""
        slot = next((s for r in ROLES for s in self.slots[r] if any(p.launch.name == proc.name for p in s.parts)), None)
        if slot is None or slot.state == "stopped":
            return
        lines = [line for line in proc.log_tail(LOG_LINES).splitlines() if line.strip()]
        self._step_failed(slot, proc.name, how, lines)

    def _step_failed(self, slot: Slot, name: str, how: str, lines: list[str]) -> None:
        """Stop what is left of `slot` and report it: a drain ended by the engine's death, or a failed scale step
        tried again after the role's backoff."""
        was = slot.state
        for part in slot.parts:
            if part.launch.name != name and self.sup.states.get(part.launch.name) in RUNNING:
                self.sup.retire(part.launch.name)
        slot.state = "stopped"
        self._post_drain(slot.url, True)  # the proxy routes it nothing new (404 when it never joined)
        desired = (self.desired or {}).get(slot.role, 0)
        engine = slot.engine.launch.name
        if was == "draining":
            self._emit("stopped", slot.role, engine, f"stopped {engine} ({name} {how} while draining)", desired, tail=lines)
            return
        delay = self.backoff[slot.role].failed(self.clock())
        self._emit("scale-failed", slot.role, engine, f"{name} {how}: adding {engine} failed; the engines serving keep serving, "
                   f"and it is tried again in {delay:g} s while the planner asks for {desired} {slot.role} engine(s)", desired, tail=lines)

    # --- scale down
    def _drain(self, slot: Slot, desired: int, now: float) -> None:
        if self.sup.states.get(slot.engine.launch.name) != "ready":  # still starting: no request can be on it
            self._stop(slot, desired, 0, "it was still starting")
            return
        slot.state, slot.drain_since = "draining", now
        answer = self._post_drain(slot.url, True)
        n = answer.in_flight if isinstance(answer, DrainAnswer) else None
        self._emit("draining", slot.role, slot.engine.launch.name, f"draining {slot.engine.launch.name}: no new requests, "
                   f"{n if n is not None else 'its'} request(s) in flight finish first; the planner asks for {desired}", desired, n)
        self._drain_step(slot, now)

    def _drain_step(self, slot: Slot, now: float) -> None:
        answer = self._post_drain(slot.url, True)
        n = answer.in_flight if isinstance(answer, DrainAnswer) else None
        desired = (self.desired or {}).get(slot.role, 0)
        if answer == "unknown":
            self._stop(slot, desired, 0, "the proxy does not route to it")
        elif n == 0 and self._engine_idle(slot.url):
            self._stop(slot, desired, 0, "its requests finished")
        elif now - slot.drain_since >= self.auto.drain_timeout_s:
            self._stop(slot, desired, n, f"the drain timed out after {self.auto.drain_timeout_s:g} s with {n} request(s) in flight")

    def _undrain(self, slot: Slot, desired: int) -> None:
        self._post_drain(slot.url, False)
        slot.state = "active"
        self._emit("undrained", slot.role, slot.engine.launch.name, f"{slot.engine.launch.name} takes requests again: the planner asks "
                   f"for {desired}", desired)  # fmt: skip

    def _stop(self, slot: Slot, desired: int, in_flight: int | None, why: str) -> None:
        name = slot.engine.launch.name
        slot.state = "stopped"  # first: a stop that raises must not leave the slot draining, tried every round
        code = self.sup.retire(name)
        self._emit("stopped", slot.role, name, f"stopped {name} ({why}; exit code {code})", desired, in_flight)

    # --- the proxy
    def _emit(self, kind: ScaleKind, role: Role, name: str, message: str, desired: int, in_flight: int | None = None,
              tail: list[str] | None = None) -> None:
        event = ScaleEvent(kind, role, name, message, desired, len(self.active(role)), in_flight, tail or [])
        log.info("autoscale: %s", message)
        try:
            self.on_event(event)
        except Exception:  # reporting must not stop scaling
            log.exception("scale event report failed")

    def _proxy(self) -> ProxyClient:
        if self._client is None:
            self._client = ProxyClient(self.proxy_url, timeout=2.0)
        return self._client

    def _engine_idle(self, url: str) -> bool:
        """Whether the engine itself runs and queues nothing (vllm:num_requests_running and _waiting on its /metrics):
        the proxy's count ends with the client's answer, an engine's own work may trail it. True when unreadable."""
        try:
            with EngineClient(url, timeout=2.0) as engine:
                return engine.load().requests == 0
        except (UnreachableError, RemoteError):
            return True

    def _post_drain(self, url: str, on: bool) -> DrainAnswer | Literal["unknown"] | None:
        """The proxy's answer; "unknown" when it has no backend at `url` (404), None when it did not answer."""
        try:
            return self._proxy().drain(url, on)
        except RemoteError as exc:
            return "unknown" if exc.status == 404 else None
        except UnreachableError:
            return None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

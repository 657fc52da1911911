"""`pdkv up`'s run: starting, watching and stopping the parts the plan resolved (`PartsRun`), and what comes before.

`hand_out_key` puts the deployment key where every part inherits it. `prepare` refuses to start what a
deployment recorded in the log folder still runs (pdkv.deploy.run.leftovers), runs the pre-flight checks and
writes what the parts need. `PartsRun` starts the parts stage by stage, warms the deployment up, watches
(restarting by each part's policy, and with `[autoscale]` starting and draining engines as the proxy's planner
asks: pdkv.deploy.run.autoscaler) and stops them all, with SIGINT, SIGTERM and SIGHUP stopping cleanly; its
lifeline (pdkv.deploy.run.lifeline) records the parts beside their logs and has a watchdog stop them should this
process end without doing so. Nothing here prints: the command renders what the callbacks and results say.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pdkv.auth import TOKEN_ENV, token_from_env
from pdkv.deploy.plan import Deployment, Part, Startup, allocate_ports, exposure_warnings, write_logging_config
from pdkv.deploy.run.autoscaler import Autoscaler, ScaleEvent
from pdkv.deploy.run.leftovers import PartRecord, ports_of, raise_conflicts
from pdkv.deploy.run.lifeline import Lifeline
from pdkv.deploy.run.preflight import preflight, raise_problems
from pdkv.deploy.run.restart import RestartPolicy
from pdkv.deploy.run.stages import start_stages
from pdkv.deploy.run.supervisor import PartEvent, Supervisor
from pdkv.deploy.run.warmup import WARMUP_TIMEOUT_S, warm_up_deployment
from pdkv.doctor import VLLM_EXTENSIBLE_KV_CACHE, installed_vllm, version_tuple
from pdkv.errors import PdkvError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal `pdkv up` ran in was closed


def _extensible_release() -> bool:
    """Whether the vLLM this interpreter would start has the extensible KV cache (0.34+): `start_stages` needs it."""
    _, version = installed_vllm()
    return version is not None and version_tuple(version)[:2] >= VLLM_EXTENSIBLE_KV_CACHE


def hand_out_key(token: str | None, parts: Sequence[Part]) -> list[str]:
    """Put the deployment key (`token`, else PDKV_TOKEN's) in the environment every part inherits; one line for
    each side channel or bootstrap that is reachable beyond loopback without one."""
    token = token or token_from_env()
    if token:
        os.environ[TOKEN_ENV] = token  # never in a part's env: those are printed (--dry-run)
    return exposure_warnings(parts, keyed=bool(token))


def prepare(startup: Startup, log_dir: str | Path) -> None:
    """StartError when a deployment started with `log_dir` still runs a part of the startup's names or ports (naming
    them and the command that stops them); then the pre-flight checks (PreflightError listing every problem; the
    ports of the engines `[autoscale]` may add among them), and vLLM's logging configuration written into
    `log_dir`. The tiny model, if used, must be in its cache already (pdkv.tinymodel.ensure_tiny_model)."""
    raise_conflicts(log_dir, startup.parts)
    reserved = allocate_ports(startup.autoscale).reserved() if startup.autoscale is not None else []
    raise_problems(preflight(startup.parts, startup.bootstraps, reserved=reserved))
    write_logging_config(startup.parts, log_dir)


def served_model(parts: Sequence[Part], served: str | None) -> str:
    """The model name requests to this deployment carry."""
    if served:
        return served
    return next(p for p in parts if p.spec is not None).spec.model  # type: ignore[union-attr]


class PartsRun:
    """Every part of a startup under one supervisor: `with PartsRun(...) as run: run.start(); run.warm_up(); run.watch()`.

    Inside the `with`, SIGTERM and SIGHUP stop cleanly like Ctrl-C (KeyboardInterrupt), also when the shell
    started `pdkv up` with SIGINT ignored; leaving it stops every part with the three signals ignored (a second
    Ctrl-C must not orphan an engine), then puts SIGTERM's and SIGHUP's handlers back and SIGINT's to
    KeyboardInterrupt. The `with` holds the lifeline: every part started inside it is recorded in `log_dir` and
    stopped by the watchdog if this process ends without stopping it. `command` is the command line the record
    shows (default: this process's). `on_line(name, line)` gets every output line, `on_event` every PartEvent
    of the watch, `on_change()` runs after each state change.
    """

    def __init__(
        self, parts: Sequence[Part], log_dir: str | Path, *, restart: Literal["on-failure", "no"] | None = None,
        on_line: Callable[[str, str], None] | None = None, on_event: Callable[[PartEvent], None] | None = None,
        autoscale: Deployment | None = None, on_scale: Callable[[ScaleEvent], None] | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        self.parts = list(parts)
        restart_with: dict[str, list[str]] = {}
        for p in self.parts:
            if p.registers_with:
                restart_with.setdefault(p.registers_with, []).append(p.launch.name)
        self.supervisor = Supervisor(
            [p.launch for p in self.parts], log_dir, on_line=on_line, stages=start_stages(self.parts, _extensible_release()),
            restart=[RestartPolicy(restart or p.restart) for p in self.parts], restart_with=restart_with, on_event=on_event,
        )
        self._previous: dict[int, Any] = {}
        proxy = next((p for p in self.parts if p.kind == "proxy"), None)
        self.autoscaler = None if autoscale is None or proxy is None else Autoscaler(
            autoscale, self.supervisor, self.parts, proxy.launch.url, log_dir, on_event=on_scale)
        records = [PartRecord.of(p) for p in self.parts]
        self.lifeline = Lifeline(log_dir, command=list(command) if command is not None else sys.argv, parts=records,
                                 ports_of=self._ports_of)

    def _ports_of(self, name: str) -> list[tuple[str, int]]:
        """The ports of part `name` (an engine the autoscaler added, too)."""
        parts = list(self.parts)
        if self.autoscaler is not None:  # its slots hold the engines (and bootstraps) it added
            parts += [p for slots in self.autoscaler.slots.values() for slot in slots for p in slot.parts]
        return next((ports_of(p) for p in parts if p.launch.name == name), [])

    def __enter__(self) -> PartsRun:
        self.lifeline.open()
        self._previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        try:
            if self.autoscaler is not None:
                self.autoscaler.close()
            self.supervisor.stop_all()
        finally:
            self.lifeline.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, self._previous[sig])

    def start(self, timeout: float) -> float:
        """Start every part, stage by stage, each healthy within `timeout` s; the seconds it took."""
        return self.supervisor.start_all(timeout)

    def warm_up(self, served: str | None, timeout: float) -> list[float]:
        """One request through the proxy (or each engine), so the first client's is not the slow one; ms each."""
        return warm_up_deployment(self.parts, served_model(self.parts, served), timeout=min(timeout, WARMUP_TIMEOUT_S))

    def watch(self) -> None:
        """Until a part dies and is not started again: then PdkvError naming it, with its log's tail."""
        sup = self.supervisor
        dead = sup.watch(every=self.autoscaler.tick if self.autoscaler is not None else None)
        assert dead is not None  # watch returns None only when asked to stop
        why = "no part is left running" if sup.states[dead.name] == "failed" else "it is not restarted"
        raise PdkvError(f"{dead.name} exited with code {dead.poll()} and {why}; stopping the rest.\n{dead.log_tail(20)}",
                        hint=f"read {dead.log_path}")

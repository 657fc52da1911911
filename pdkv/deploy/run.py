"""`pdkv up` as a library: which parts to start (`resolve`), and starting, watching and stopping them (`PartsRun`).

`resolve(UpOptions)` turns the command's options into the parts to start on
this host (a deployment file's, one engine by role, or the built-in local
1P1D), with vLLM's logging routed to the parts' log files. `hand_out_key`
puts the deployment key where every part inherits it. `prepare` writes what
the parts need and runs the pre-flight checks. `PartsRun` starts the parts
stage by stage, warms the deployment up, watches (restarting by each part's
policy, and with `[autoscale]` starting and draining engines as the proxy's
planner asks: pdkv.deploy.autoscale) and stops them all, with SIGINT, SIGTERM and SIGHUP stopping cleanly; its
lifeline (pdkv.deploy.lifeline) records the parts beside their logs and has a watchdog stop them should this
process end without doing so. `prepare` refuses to start what a deployment recorded there still runs
(pdkv.deploy.leftovers). Nothing here prints: the command renders what the callbacks and results say.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from pdkv.auth import TOKEN_ENV, token_from_env
from pdkv.bootstrap import DEFAULT_PORT as DEFAULT_BOOTSTRAP_PORT
from pdkv.deploy.exposure import exposure_warnings
from pdkv.deploy.fleet import chosen_hosts
from pdkv.deploy.leftovers import PartRecord, ports_of, raise_conflicts
from pdkv.deploy.lifeline import Lifeline
from pdkv.deploy.loader import load_deployment
from pdkv.deploy.schema import Deployment
from pdkv.deploy.machine import gpu_count, local_addresses
from pdkv.deploy.ports import allocate_ports
from pdkv.deploy.preflight import preflight, raise_problems
from pdkv.deploy.scaling import autoscaled
from pdkv.deploy.restart import RestartPolicy
from pdkv.deploy.single import role_parts, split_cores, with_cores, with_extra
from pdkv.deploy.stages import start_stages
from pdkv.deploy.autoscale import Autoscaler, ScaleEvent
from pdkv.deploy.supervisor import PartEvent, Supervisor
from pdkv.deploy.topology import TINY_SERVED_NAME, Part, deployment_parts, external_bootstraps, local_deployment
from pdkv.deploy.vllm_logging import with_vllm_logging, write_logging_config
from pdkv.deploy.warmup import WARMUP_TIMEOUT_S, warm_up_deployment
from pdkv.doctor import VLLM_EXTENSIBLE_KV_CACHE, installed_vllm, version_tuple
from pdkv.errors import PdkvError, UsageError
from pdkv.tinymodel import tiny_model_path
from pdkv.transport import TRANSPORTS

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal `pdkv up` ran in was closed


def _extensible_release() -> bool:
    """Whether the vLLM this interpreter would start has the extensible KV cache (0.34+): `start_stages` needs it."""
    _, version = installed_vllm()
    return version is not None and version_tuple(version)[:2] >= VLLM_EXTENSIBLE_KV_CACHE


class UpOptions(msgspec.Struct, frozen=True, kw_only=True):
    """`pdkv up`'s options: a deployment file (`file`), one engine (`role`), or neither (the local 1P1D)."""

    file: Path | None = None
    role: str | None = None
    model: str | None = None
    connector: str = "pdkv"
    transport: str | None = None  # how the KV moves (the file's `transport`, the CLI's `--transport`)
    device: str = ""
    gpu: str | None = None
    port: int | None = None
    host: str | None = None  # with `file`: a [[hosts]] name
    listen: str | None = None  # with `role`: the address the engine listens on
    host_ip: str | None = None
    bootstrap_port: int | None = None
    bootstrap: str | None = None
    members: str | None = None
    block_size: int | None = None
    tp: int = 1
    platform: str | None = None
    omp_bind: str | None = None
    timeout: float = 900.0
    restart: str | None = None
    extra: tuple[str, ...] = ()


class Startup(msgspec.Struct, kw_only=True):
    """What one `pdkv up` starts on this host, and what it needs to know to start it."""

    parts: list[Part]
    bootstraps: list[str]  # bootstrap servers the parts use and do not start (checked before starting)
    served: str | None  # the model name the engines serve, when not their model path
    timeout: float  # seconds each part may take to become healthy
    token: str | None  # the deployment file's key, if it has one
    uses_tiny: bool  # the embedded tiny model must be in its cache first
    autoscale: Deployment | None = None  # the deployment whose [autoscale] this `pdkv up` acts on (pdkv.deploy.autoscale)
    notes: list[str] = []  # warnings for the command to show


def _check_options(o: UpOptions, gpus: int) -> None:
    for value, allowed, flag in ((o.connector, ("pdkv", "mooncake"), "--connector"),
                                 (o.transport, (*TRANSPORTS, None), "--transport"),
                                 (o.platform, ("gpu", "cpu", None), "--platform"), (o.restart, ("on-failure", "no", None), "--restart")):
        if value not in allowed:
            raise UsageError(f"{flag} {value!r} is not one of {', '.join(a for a in allowed if a)}")
    if o.file is not None and o.role is not None:
        raise UsageError("give either -f FILE or --role, not both")
    if o.members is not None and o.role is None:
        raise UsageError("--members goes with --role", hint="a deployment file's engines join its first bootstrap's registry by themselves")
    if o.host is not None and o.role is not None:
        raise UsageError("--host goes with -f FILE (a [[hosts]] name), not with --role",
                         hint="the address an engine started by --role listens on is --listen")
    if o.host is not None and o.file is None:
        raise UsageError("--host goes with -f FILE (a [[hosts]] name)", hint="an engine's listen address is --listen, with --role")
    if o.listen is not None and o.role is None:
        raise UsageError("--listen goes with --role", hint="a deployment file's parts listen on its `host`")
    if o.transport == "ipc" and (o.platform == "cpu" or (o.platform is None and not gpus)):
        raise UsageError("--transport ipc moves KV between GPUs, and no GPU is in use here", hint="use --transport tcp or cma on CPU hosts")
    if o.transport == "cma" and (o.platform == "gpu" or (o.platform is None and gpus)):
        raise UsageError("--transport cma moves KV in host memory, and these engines keep it on a GPU",
                         hint="use --transport ipc between GPUs of this host")


def select_parts(parts: Sequence[Part], hosts: set[str] | None) -> list[Part]:
    """The parts on `hosts` (all when None). A prefill whose bootstrap runs elsewhere no longer restarts with it."""
    if hosts is None:
        return list(parts)
    chosen = [p for p in parts if p.host in hosts]
    if not chosen:
        raise UsageError(f"host {', '.join(sorted(hosts))} runs no part of the deployment",
                         hint="give it a part (host = NAME) or pass another --host")
    here = {p.launch.name for p in chosen}
    return [p if p.registers_with is None or p.registers_with in here else msgspec.structs.replace(p, registers_with=None) for p in chosen]


def resolve(o: UpOptions, log_dir: str | Path) -> Startup:
    """The parts one `pdkv up` starts on this host, each with vLLM's logging into `log_dir`. UsageError or
    ConfigError (one line) for options or a file that cannot be started as given."""
    gpus = gpu_count()
    _check_options(o, gpus)
    served: str | None = None
    uses_tiny = o.model is None and o.file is None
    token: str | None = None
    timeout = o.timeout
    notes: list[str] = []
    if o.file is not None:
        dep = load_deployment(o.file)
        token = dep.token
        if o.extra:
            dep = with_extra(dep, list(o.extra))
        dep, notes = autoscaled(dep, o.file)
        # A fleet file: the parts of this host (--host NAME, else the hosts with one of this machine's addresses).
        here = chosen_hosts(dep, o.host, local_addresses() if o.host is None and dep.hosts else ())
        parts = select_parts(deployment_parts(dep), here)
        boots, served, timeout = external_bootstraps(dep), dep.served_model_name, min(timeout, dep.startup_timeout)
        if not any(p.spec is not None for p in parts):  # a fleet host with no engine (its proxy warms up by the deployment's model)
            served = served or dep.model
    elif o.role is not None:
        plat = o.platform or ("gpu" if gpus else "cpu")
        role = o.role
        parts, boots = role_parts(
            role,
            o.members,
            model=o.model or str(tiny_model_path()),
            host=o.listen or "0.0.0.0",
            port=o.port or (8100 if role == "prefill" else 8200),
            connector=o.connector,
            transport=o.transport or ("tcp" if plat == "cpu" else "rdma"),
            device=o.device,
            platform=plat,
            gpu=o.gpu,
            tp=o.tp,
            block_size=o.block_size if o.block_size is not None else (32 if plat == "cpu" else None),
            # P's in-worker bootstrap port is set explicitly, so two prefills on one host never share 8998 by accident.
            bootstrap_port=o.bootstrap_port if o.bootstrap_port is not None or role == "decode" or o.bootstrap else DEFAULT_BOOTSTRAP_PORT,
            bootstrap_url=o.bootstrap,
            host_ip=o.host_ip,
            omp_bind=o.omp_bind,
            served_model_name=TINY_SERVED_NAME if uses_tiny else None,
            extra_args=o.extra,
        )
        served = TINY_SERVED_NAME if uses_tiny else None
    else:
        dep = local_deployment(gpus=0 if o.platform == "cpu" else gpus, model=o.model, connector=o.connector,  # type: ignore[arg-type]
                               transport=o.transport, device=o.device, proxy_port=o.port or 8000)  # type: ignore[arg-type]
        if dep.platform == "cpu":
            p_cores, d_cores = split_cores()
            dep = with_cores(dep, p_cores, d_cores)
        if o.extra:
            dep = with_extra(dep, list(o.extra))
        parts, boots, served = deployment_parts(dep), [], dep.served_model_name
    scaled = dep if o.file is not None and dep.autoscale is not None and not dep.hosts else None
    return Startup(parts=with_vllm_logging(parts, log_dir), bootstraps=boots, served=served, timeout=timeout, token=token,
                  uses_tiny=uses_tiny, autoscale=scaled, notes=notes)


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

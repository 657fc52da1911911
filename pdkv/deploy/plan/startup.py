"""`pdkv up`'s options to the parts this host starts (`resolve`): the plan's front door. Pure, but for reading the
file, the profile `[autoscale]` names and what this machine has; nothing starts here.

`resolve(UpOptions)` turns the command's options into a `Startup`: the parts to start on this host (a
deployment file's, one engine by role, or the built-in local 1P1D), with vLLM's logging routed to the parts'
log files, the bootstraps they use and do not start, and the deployment whose `[autoscale]` the run acts on.
Starting them is pdkv.deploy.run's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from pdkv.bootstrap import DEFAULT_PORT as DEFAULT_BOOTSTRAP_PORT
from pdkv.deploy.plan.added_engines import autoscaled
from pdkv.deploy.plan.cores import split_cores
from pdkv.deploy.plan.fleet import chosen_hosts
from pdkv.deploy.plan.loader import load_deployment
from pdkv.deploy.plan.machine import gpu_count, local_addresses
from pdkv.deploy.plan.schema import Deployment
from pdkv.deploy.plan.topology import TINY_SERVED_NAME, Part, deployment_parts, external_bootstraps, local_deployment, role_parts
from pdkv.deploy.plan.vllm_logging import with_vllm_logging
from pdkv.errors import UsageError
from pdkv.tinymodel import TINY_KV_CACHE_BYTES, tiny_model_path
from pdkv.transport import TRANSPORTS


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
    autoscale: Deployment | None = None  # the deployment whose [autoscale] this `pdkv up` acts on (pdkv.deploy.run.autoscaler)
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


def with_cores(dep: Deployment, p_cores: str, d_cores: str) -> Deployment:
    """`dep` with every prefill bound to `p_cores` and every decode to `d_cores` (the local 1P1D on CPU)."""
    prefill = [msgspec.structs.replace(e, omp_bind=p_cores) for e in dep.prefill]
    decode = [msgspec.structs.replace(e, omp_bind=d_cores) for e in dep.decode]
    return msgspec.structs.replace(dep, prefill=prefill, decode=decode)


def with_extra(dep: Deployment, extra: list[str]) -> Deployment:
    """`dep` with `extra` (`pdkv up`'s arguments after --) after every engine's vLLM arguments."""
    return msgspec.structs.replace(dep, extra_args=[*dep.extra_args, *extra])


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
            cpu_kv_cache_bytes=None if o.model else TINY_KV_CACHE_BYTES,
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



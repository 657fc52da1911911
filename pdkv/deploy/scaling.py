"""What an autoscaled deployment runs beyond its file (pure, but for asking which ports are free): each role's
engine slots, the parts of an engine added to a role, and how many to start or drain for a desired count.

Slot k of a role is the engine named `prefill-k` / `decode-k`: the tables the
file lists are slots 0..n-1; an added engine takes the next slot, with the
role's first table's settings, a port of its own, its KV events ports, its
cores or GPUs from `[autoscale.ROLE]` (pdkv.deploy.schema.RoleBounds) and,
for a prefill with a standalone bootstrap, a bootstrap server of its own on
the port `pdkv up` would give that slot. Every engine joins the first
prefill's members registry, as the listed ones do, so the proxy routes to it
without a restart.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

import msgspec

from pdkv.deploy.engine import parse_cores
from pdkv.deploy.schema import Deployment, EngineEntry
from pdkv.deploy.topology import Part, deployment_parts
from pdkv.errors import ConfigError
from pdkv.planner import load_profile

Role = Literal["prefill", "decode"]


def autoscaled(dep: Deployment, file: str | Path) -> tuple[Deployment, list[str]]:
    """`dep` as `pdkv up -f file` runs it: `[autoscale]`'s profile found beside the file (and loaded: ConfigError if
    it does not), the table checked against this way of running; with warnings. A fleet (`[[hosts]]`) is not
    autoscaled here: its table is for `pdkv k8s render`."""
    a = dep.autoscale
    if a is None:
        return dep, []
    if dep.hosts:
        return dep, ["[autoscale] is left to `pdkv k8s render` for a file with [[hosts]]: pdkv up scales the engines of one host"]
    source = str(file)
    if dep.connector != "pdkv":
        raise ConfigError(f"{source}: [autoscale] needs connector = \"pdkv\"",
                          hint="added engines join the proxy through pdkv's members registry; vLLM's MooncakeConnector has none")
    if dep.proxy is None:
        raise ConfigError(f"{source}: [autoscale] needs the [proxy]: its planner signal says how many engines to run")
    path = Path(a.profile).expanduser()
    path = path if path.is_absolute() else Path(file).resolve().parent / path
    load_profile(path)  # ConfigError naming the file when it does not load
    for role, bounds, listed in (("prefill", a.prefill, dep.prefill), ("decode", a.decode, dep.decode)):
        if dep.platform == "gpu" and bounds.max > len(listed) and len(bounds.gpu) < bounds.max - len(listed):
            raise ConfigError(f"{source}: [autoscale.{role}] may add {bounds.max - len(listed)} engine(s) and names {len(bounds.gpu)} gpu",
                              hint=f'give each added engine its GPUs: gpu = ["1", ...] ({bounds.max - len(listed)} entries)')
        for bind in bounds.omp_bind:
            parse_cores(bind)  # UsageError for a list it cannot read
    return msgspec.structs.replace(dep, autoscale=msgspec.structs.replace(a, profile=str(path))), []


def added_entry(dep: Deployment, role: Role, added: int, port: int, events_port: int | None, busy_cores: dict[int, int]) -> EngineEntry:
    """The table of the role's `added`-th added engine (0: the first beyond the file's): the role's first table
    with `port`, `events_port` and its own cores (CPU) or GPUs. `busy_cores`: engines bound to each core now."""
    assert dep.autoscale is not None
    template = (dep.prefill if role == "prefill" else dep.decode)[0]
    bounds = dep.autoscale.prefill if role == "prefill" else dep.autoscale.decode
    entry = msgspec.structs.replace(template, port=port, kv_events_port=events_port, replicas=1, host=None)
    if dep.platform == "cpu":
        if bounds.omp_bind:
            return msgspec.structs.replace(entry, omp_bind=bounds.omp_bind[added % len(bounds.omp_bind)])
        want = len(parse_cores(template.omp_bind) or [0])
        return msgspec.structs.replace(entry, omp_bind=least_bound_cores(busy_cores, want))
    if not bounds.gpu:
        raise ConfigError(f"[autoscale.{role}] needs gpu = [...] naming each added engine's GPUs",
                          hint='e.g. gpu = ["1", "2"]: an added engine on the first table\'s GPU would not fit beside it')
    return msgspec.structs.replace(entry, gpu=bounds.gpu[added % len(bounds.gpu)])


def least_bound_cores(busy: dict[int, int], want: int) -> str:
    """`want` cores of this host with the fewest engines bound to them (the higher-numbered first on a tie: core
    0 takes the system's own work), as an omp_bind value."""
    cores = sorted(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))
    chosen = sorted(sorted(cores, key=lambda c: (busy.get(c, 0), -c))[: max(1, want)])
    return ",".join(map(str, chosen))


def slot_parts(dep: Deployment, role: Role, slot: int, entry: EngineEntry) -> list[Part]:
    """The parts of `role`'s slot `slot` running `entry`: [bootstrap, prefill] (standalone bootstrap) or [engine]."""
    listed = dep.prefill if role == "prefill" else dep.decode
    filler = [*listed, *[entry] * (slot - len(listed)), entry]
    trial = msgspec.structs.replace(dep, proxy=None, prefill=filler if role == "prefill" else dep.prefill,
                                    decode=filler if role == "decode" else dep.decode)
    names = {f"{role}-{slot}", f"bootstrap-{slot}" if role == "prefill" else ""}
    return [p for p in deployment_parts(trial) if p.plan.name in names]


def free_port(start: int, taken: set[int], is_free: Callable[[int], bool], *, step: int = 1) -> int:
    """The first port from `start` (by `step`) not in `taken` that `is_free` says nobody holds; ConfigError past 65535."""
    port = start
    while port < 65536:
        span = range(port, port + step)
        if all(p not in taken for p in span) and all(is_free(p) for p in span):
            return port
        port += step
    raise ConfigError(f"no free port from {start} up for an added engine", hint="free some ports, or lower the autoscale max")


def ports_of(parts: Iterable[Part]) -> set[int]:
    return {port for p in parts for _, port in p.ports}


def scale_steps(desired: int, active: int, bounds: tuple[int, int]) -> int:
    """Engines to start (> 0) or drain (< 0) to bring `active` (running or starting) to `desired` within `bounds`."""
    lo, hi = bounds
    target = min(hi, max(lo, desired))
    return target - active

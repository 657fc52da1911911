"""What an autoscaled deployment runs beyond its file (pure): `[autoscale]` checked for `pdkv up -f`, and the table
and parts of each engine it may add to a role. When to add or drain one is the run's (pdkv.deploy.run.autoscaler,
by the rules of pdkv.deploy.run.scale_policy).

Slot k of a role is the engine named `prefill-k` / `decode-k`: the tables the
file lists are slots 0..n-1; an added engine takes the next slot, with the
role's first table's settings, the ports pdkv.deploy.plan.ports reserved for that
slot (its HTTP port, KV events, side channel and, for a prefill with a
standalone bootstrap, a bootstrap server of its own), and its cores or GPUs
from `[autoscale.ROLE]` (pdkv.deploy.plan.schema.RoleBounds). Every engine joins
the first prefill's members registry, as the listed ones do, so the proxy
routes to it without a restart.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from pdkv.deploy.plan.cores import least_bound_cores, parse_cores
from pdkv.deploy.plan.ports import EngineSlot, PortAllocation, Role
from pdkv.deploy.plan.schema import Deployment, EngineEntry
from pdkv.deploy.plan.topology import Part, slot_parts
from pdkv.errors import ConfigError
from pdkv.planner import load_profile


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


def added_entry(dep: Deployment, role: Role, added: int, busy_cores: dict[int, int]) -> EngineEntry:
    """The table of the role's `added`-th added engine (0: the first beyond the file's): the role's first table
    with its own cores (CPU) or GPUs; its ports are its slot's (pdkv.deploy.plan.ports). `busy_cores`: engines bound
    to each core now."""
    assert dep.autoscale is not None
    template = (dep.prefill if role == "prefill" else dep.decode)[0]
    bounds = dep.autoscale.prefill if role == "prefill" else dep.autoscale.decode
    entry = msgspec.structs.replace(template, kv_events_port=None, replicas=1, host=None)
    if dep.platform == "cpu":
        if bounds.omp_bind:
            return msgspec.structs.replace(entry, omp_bind=bounds.omp_bind[added % len(bounds.omp_bind)])
        want = max(len(parse_cores(template.omp_bind) or []), template.tp)  # a core of its own for each TP rank
        return msgspec.structs.replace(entry, omp_bind=least_bound_cores(busy_cores, want))
    if not bounds.gpu:
        raise ConfigError(f"[autoscale.{role}] needs gpu = [...] naming each added engine's GPUs",
                          hint='e.g. gpu = ["1", "2"]: an added engine on the first table\'s GPU would not fit beside it')
    return msgspec.structs.replace(entry, gpu=bounds.gpu[added % len(bounds.gpu)])


def added_slot_parts(dep: Deployment, ports: PortAllocation, role: Role, index: int, entry: EngineEntry) -> list[Part]:
    """The parts of `role`'s slot `index` running `entry` on the ports `ports` reserved for it (pdkv.deploy.plan.ports):
    [bootstrap, prefill] (standalone bootstrap) or [engine]. ConfigError for a slot past the role's max."""
    name = f"{role}-{index}"
    if name not in ports.slots:
        raise ConfigError(f"{name} is past [autoscale.{role}] max: no ports are reserved for it")
    return slot_parts(dep, EngineSlot(role, index, entry, added=True), ports)

"""Every port a deployment file can ever have bound, from one allocator (pure).

`allocate_ports(dep)` gives each engine slot its ports: the engines the file
lists and, on one host, every engine `[autoscale]` may add up to its roles'
`max` (pdkv.deploy.plan.added_engines starts them later, on exactly these ports, and
pre-flight checks them before anything starts). Each `PortUse` names the part,
what binds the port and the setting it comes from, so that pre-flight can say
which setting to change (pdkv.deploy.run.preflight.check_ports).

Ports written in the file are taken as written: each engine table's `port`,
`[proxy] port`, `[bootstrap] port` (the first prefill's bootstrap) and a
table's own `kv_events_port` and (transport socket) a decode table's `socket_port`. Every other port is derived, in this order, as
the first ports from where it would start that no other part of its host has:

- the bootstrap of prefill k (k > 0): from the one before it, + 1;
- the HTTP port of an engine `[autoscale]` may add: from the role's highest listed port, + 1;
- KV events (vLLM's publisher and replay socket, two per DP rank): from `kv_events_port`,
  the listed engines (prefills, then decodes) first, then the ones `[autoscale]` may add;
- pdkv's side channel of each prefill (one per TP rank of each DP rank): after the KV events;
- transport socket, the KV listener of each decode without its own `socket_port` (one per TP rank): after those.

A port written twice is left as written: pre-flight names both parts. vLLM's
own MooncakeConnector binds its side channel to a port the system picks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import msgspec

from pdkv.deploy.plan.engine import data_parallel_size
from pdkv.deploy.plan.schema import Deployment, EngineEntry
from pdkv.errors import ConfigError

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")
ANY_ADDRESS = "0.0.0.0"


class PortUse(msgspec.Struct, frozen=True):
    """One port a part binds: which part, what binds it, on which address, and the file's setting it comes from."""

    part: str  # the part's name: prefill-1, bootstrap-0, proxy
    what: str  # HTTP, bootstrap, KV events publisher, KV events replay, side channel
    bind: str  # the address it binds (a check of the port binds there)
    port: int
    setting: str  # the deployment file's key it comes from, in the words of the file
    host: str | None = None  # its [[hosts]] name in a fleet

    def __iter__(self) -> Iterator[str | int]:
        """`bind, port = use`: where and which, for a caller that needs no more."""
        return iter((self.bind, self.port))


class SlotPorts(msgspec.Struct, frozen=True):
    """The ports of one engine slot (the engine named `prefill-k` or `decode-k`)."""

    http: int
    bootstrap: int | None = None  # a prefill's standalone or in-worker bootstrap server
    kv_events: int | None = None  # the first of its KV events ports (pdkv.deploy.plan.engine.kv_events_config)
    side_channel: int | None = None  # pdkv's connector on a prefill: TP rank r of DP rank d binds + d * tp + r
    socket: int | None = None  # transport socket, a decode's KV listener: TP rank r binds + r


class PortAllocation(msgspec.Struct, frozen=True):
    """Every engine slot's ports, the proxy's, and every port as a `PortUse`; `added` names the parts that only
    `[autoscale]` starts."""

    slots: dict[str, SlotPorts]
    uses: list[PortUse]
    added: frozenset[str] = frozenset()

    def of(self, part: str) -> list[PortUse]:
        """The ports part `part` binds, its HTTP port first."""
        return [u for u in self.uses if u.part == part]

    def reserved(self) -> list[PortUse]:
        """The ports of the parts that only `[autoscale]` starts: pre-flight checks them with the rest."""
        return [u for u in self.uses if u.part in self.added]


class EngineSlot(msgspec.Struct, frozen=True):
    """Slot `index` of `role`: the table it runs (the role's first one for an added engine) and whether `[autoscale]` adds it."""

    role: Role
    index: int
    entry: EngineEntry
    added: bool

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def label(self) -> str:
        """The file's words for the table: `[[prefill]] 2`, or for an added engine the role's `[autoscale.prefill]`."""
        return f"[autoscale.{self.role}] max" if self.added else f"[[{self.role}]] {self.index + 1}"


def engine_slots(dep: Deployment) -> list[EngineSlot]:
    """Every engine slot of `dep`: the listed prefills, the added ones, then the same for decodes. Engines are added
    on one host only (a fleet's `[autoscale]` is `pdkv k8s render`'s)."""
    out: list[EngineSlot] = []
    for role in ROLES:
        listed = dep.prefill if role == "prefill" else dep.decode
        out += [EngineSlot(role, i, e, False) for i, e in enumerate(listed)]
        if dep.autoscale is not None and not dep.hosts and listed:
            bounds = dep.autoscale.prefill if role == "prefill" else dep.autoscale.decode
            out += [EngineSlot(role, i, listed[0], True) for i in range(len(listed), bounds.max)]
    return out


def dp_size(dep: Deployment, entry: EngineEntry) -> int:
    return data_parallel_size([*dep.extra_args, *entry.extra_args])


class _Taken:
    """The ports already given on each host, and the first free run of ports from a start."""

    def __init__(self) -> None:
        self.by_host: dict[str | None, set[int]] = {}

    def take(self, host: str | None, ports: range) -> None:
        self.by_host.setdefault(host, set()).update(ports)

    def first_free(self, host: str | None, start: int, count: int, what: str) -> int:
        taken = self.by_host.get(host, set())
        port = start
        while port + count - 1 <= 65535:
            if not any(p in taken for p in range(port, port + count)):
                self.take(host, range(port, port + count))
                return port
            port += 1
        raise ConfigError(f"no {count} free port(s) from {start} up for {what}",
                          hint="lower the ports written in the deployment file, or the autoscale max")


def _bootstrap_host(dep: Deployment, slot: EngineSlot) -> str | None:
    return dep.bootstrap.host if dep.bootstrap.mode == "standalone" else slot.entry.host


def _runs_bootstrap(dep: Deployment, slot: EngineSlot) -> bool:
    """Whether the slot's prefill has a bootstrap server of its own (standalone, or in its first worker)."""
    return slot.role == "prefill" and dep.bootstrap.mode != "external" and not slot.entry.bootstrap_url


def allocate_ports(dep: Deployment) -> PortAllocation:
    """Every port of `dep`'s parts and of the engines `[autoscale]` may add: the ports written in the file as
    written, the others derived (this module's docstring). ConfigError when a derived port would pass 65535."""
    slots = engine_slots(dep)
    taken = _Taken()
    uses: list[PortUse] = []
    http: dict[str, int] = {}
    boot: dict[str, int] = {}
    events: dict[str, int] = {}
    side: dict[str, int] = {}
    sock: dict[str, int] = {}
    socket = dep.connector == "pdkv" and dep.transport == "socket"

    def use(part: str, what: str, bind: str, port: int, setting: str, host: str | None) -> None:
        uses.append(PortUse(part, what, bind, port, setting, host))

    # Written in the file: taken first, as written.
    for s in (s for s in slots if not s.added):
        http[s.name] = s.entry.port
        taken.take(s.entry.host, range(s.entry.port, s.entry.port + 1))
        if dep.kv_events and s.entry.kv_events_port is not None:
            events[s.name] = s.entry.kv_events_port
            taken.take(s.entry.host, range(s.entry.kv_events_port, s.entry.kv_events_port + 2 * dp_size(dep, s.entry)))
        if socket and s.role == "decode" and s.entry.socket_port is not None:
            sock[s.name] = s.entry.socket_port
            taken.take(s.entry.host, range(s.entry.socket_port, s.entry.socket_port + s.entry.tp))
    if dep.proxy is not None:
        taken.take(dep.proxy.host, range(dep.proxy.port, dep.proxy.port + 1))
    prefills = [s for s in slots if _runs_bootstrap(dep, s)]
    if prefills:
        boot[prefills[0].name] = dep.bootstrap.port
        taken.take(_bootstrap_host(dep, prefills[0]), range(dep.bootstrap.port, dep.bootstrap.port + 1))
    # Derived, in order.
    for s in prefills[1:]:
        boot[s.name] = taken.first_free(_bootstrap_host(dep, s), max(boot.values()) + 1, 1, f"{s.name}'s bootstrap")
    for role in ROLES:
        listed = [http[s.name] for s in slots if s.role == role and not s.added]
        for s in (s for s in slots if s.role == role and s.added):
            http[s.name] = taken.first_free(None, max(listed) + 1, 1, f"{s.name}'s HTTP port")
            listed.append(http[s.name])
    cursor = dep.kv_events_port
    in_order = sorted(slots, key=lambda s: s.added)  # the listed engines' ports stay where they are with or without [autoscale]
    if dep.kv_events:
        for s in (s for s in in_order if s.name not in events):
            n = 2 * dp_size(dep, s.entry)
            events[s.name] = taken.first_free(s.entry.host, cursor, n, f"{s.name}'s KV events")
            cursor = events[s.name] + n
    if dep.connector == "pdkv":
        for s in (s for s in in_order if s.role == "prefill"):
            n = s.entry.tp * dp_size(dep, s.entry)
            side[s.name] = taken.first_free(s.entry.host, cursor, n, f"{s.name}'s side channel")
            cursor = side[s.name] + n
    if socket:
        for s in (s for s in in_order if s.role == "decode" and s.name not in sock):
            sock[s.name] = taken.first_free(s.entry.host, cursor, s.entry.tp, f"{s.name}'s KV listener")
            cursor = sock[s.name] + s.entry.tp

    for s in slots:
        host = s.entry.host
        written = f"{s.label} port" if not s.added else f"{s.label} (the next free port after the [[{s.role}]] ports)"
        use(s.name, "HTTP", dep.host, http[s.name], written, host)
        if s.name in boot:
            name = f"bootstrap-{s.index}" if dep.bootstrap.mode == "standalone" else s.name
            where = dep.host if dep.bootstrap.mode == "standalone" else ANY_ADDRESS
            setting = "[bootstrap] port" + ("" if s.name == prefills[0].name else " (the next free port after the bootstrap before)")
            use(name, "bootstrap", where, boot[s.name], setting, _bootstrap_host(dep, s))
        if s.name in events:
            own = s.entry.kv_events_port is not None and not s.added
            setting = f"{s.label} kv_events_port" if own else "kv_events_port"
            dp = dp_size(dep, s.entry)
            for r in range(dp):
                rank = f" (DP rank {r})" if dp > 1 else ""
                use(s.name, f"KV events publisher{rank}", ANY_ADDRESS, events[s.name] + r, setting, host)
                use(s.name, f"KV events replay{rank}", ANY_ADDRESS, events[s.name] + dp + r, setting, host)
        if s.name in side:
            n = s.entry.tp * dp_size(dep, s.entry)
            for r in range(n):
                use(s.name, f"side channel (rank {r})" if n > 1 else "side channel", ANY_ADDRESS, side[s.name] + r,
                    "kv_events_port (the ports after the KV events)", host)
        if s.name in sock:
            own = s.entry.socket_port is not None and not s.added
            setting = f"{s.label} socket_port" if own else "kv_events_port (the ports after the KV events)"
            for r in range(s.entry.tp):
                use(s.name, f"KV listener (TP rank {r})" if s.entry.tp > 1 else "KV listener", ANY_ADDRESS, sock[s.name] + r,
                    setting, host)
    if dep.proxy is not None:
        use("proxy", "HTTP", dep.host, dep.proxy.port, "[proxy] port", dep.proxy.host)
    slot_ports = {s.name: SlotPorts(http[s.name], boot.get(s.name), events.get(s.name), side.get(s.name), sock.get(s.name))
                  for s in slots}
    standalone = dep.bootstrap.mode == "standalone"
    added = frozenset(n for s in slots if s.added for n in (s.name, f"bootstrap-{s.index}" if s.name in boot and standalone else s.name))
    return PortAllocation(slots=slot_ports, uses=uses, added=added)


def distinct_per_host(uses: list[PortUse]) -> Iterator[tuple[PortUse, PortUse]]:
    """Each port use that repeats an earlier one's port on the same host, with that earlier one."""
    seen: dict[tuple[str | None, int], PortUse] = {}
    for u in uses:
        key = (u.host, u.port)
        if key in seen:
            yield u, seen[key]
        else:
            seen[key] = u

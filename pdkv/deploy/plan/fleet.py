"""A fleet: one deployment file for several hosts, and which of its parts this host starts.

    [[hosts]]
    name = "A"
    address = "10.0.0.1"
    [[hosts]]
    name = "B"
    address = "10.0.0.2"
    [bootstrap]
    host = "A"
    [proxy]
    host = "A"
    [[prefill]]
    host = "B"
    port = 8100

Every part names its host (`host = NAME`) once the file has `[[hosts]]`; a
part is reached at, and advertises to its peers, its host's address. A file
without `[[hosts]]` is one host, as before. `check_hosts` validates a file
and `chosen_hosts` names the hosts one `pdkv up` starts the parts of
(pdkv.deploy.plan.startup.select_parts picks them): pure, both.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from pdkv.deploy.plan.schema import Deployment
from pdkv.errors import ConfigError, UsageError


# pdkv's own transports move KV inside one host (process memory, CUDA IPC).
ONE_HOST_TRANSPORTS = ("cma", "ipc")


def _part_hosts(dep: Deployment) -> list[tuple[str, str | None]]:
    """(part label, host name) of every part that runs on some host."""
    named: list[tuple[str, str | None]] = []
    if dep.bootstrap.mode == "standalone":
        named.append(("[bootstrap]", dep.bootstrap.host))
    named += [(f"[[prefill]] {i + 1}", e.host) for i, e in enumerate(dep.prefill)]
    named += [(f"[[decode]] {i + 1}", e.host) for i, e in enumerate(dep.decode)]
    if dep.proxy is not None:
        named.append(("[proxy]", dep.proxy.host))
    return named


def check_hosts(dep: Deployment, *, source: str = "deployment") -> None:
    """Raise ConfigError (one line) for a fleet file that cannot be started as written."""
    if not dep.hosts:
        for label, host in _part_hosts(dep):
            if host is not None:
                raise ConfigError(f"{source}: {label} names host {host!r}, and the file has no [[hosts]]",
                                  hint='add [[hosts]] tables (name = "A", address = "10.0.0.1"), or drop the host key')
        return
    names: set[str] = set()
    addresses: dict[ipaddress.IPv4Address | ipaddress.IPv6Address, str] = {}
    for h in dep.hosts:
        if h.name in names:
            raise ConfigError(f"{source}: two [[hosts]] are named {h.name!r}", hint="give every host its own name")
        names.add(h.name)
        try:
            ip = ipaddress.ip_address(h.address)
        except ValueError:
            raise ConfigError(f"{source}: host {h.name!r} has address {h.address!r}, which is not an IPv4 or IPv6 address",
                              hint="write the address peers reach the host at, e.g. 10.0.0.1 or fd00::1") from None
        if ip.is_unspecified:
            raise ConfigError(f"{source}: host {h.name!r} has address {h.address}, which no peer can reach",
                              hint="write the host's own address, not 0.0.0.0 or ::")
        if ip in addresses:
            raise ConfigError(f"{source}: hosts {addresses[ip]!r} and {h.name!r} have one address, {h.address}",
                              hint="give every host its own address")
        addresses[ip] = h.name
    for label, host in _part_hosts(dep):
        if host is None:
            raise ConfigError(f"{source}: {label} names no host, and the file has [[hosts]]",
                              hint=f"add host = NAME to it (one of {', '.join(sorted(names))})")
        if host not in names:
            raise ConfigError(f"{source}: {label} names host {host!r}, which is not among the [[hosts]] ({', '.join(sorted(names))})",
                              hint="add that [[hosts]] table or correct the name")
    if dep.transport in ONE_HOST_TRANSPORTS:
        engines = {e.host for e in (*dep.prefill, *dep.decode)}
        if len(engines) > 1:
            raise ConfigError(f"{source}: transport {dep.transport} moves KV inside one host, and the engines are on {len(engines)}",
                              hint='use transport = "tcp" or "rdma" across hosts')


def host_address(dep: Deployment, name: str | None) -> str | None:
    """The address of host `name` in `dep` (None for a single-host file)."""
    if name is None:
        return None
    return next(h.address for h in dep.hosts if h.name == name)


def chosen_hosts(dep: Deployment, host: str | None, local_addresses: Iterable[str]) -> set[str] | None:
    """The host names whose parts this `pdkv up` starts: `host` when given, else every host whose address is
    one of `local_addresses`; None for a single-host file (every part). UsageError when nothing matches."""
    names = [h.name for h in dep.hosts]
    if not dep.hosts:
        if host is not None:
            raise UsageError(f"--host {host}: the deployment file has no [[hosts]]", hint="drop --host to start every part")
        return None
    if host is not None:
        if host not in names:
            raise UsageError(f"--host {host}: no such host in the deployment file (hosts: {', '.join(names)})",
                             hint="pass one of those names")
        return {host}
    local = {ipaddress.ip_address(a.split("%", 1)[0]) for a in local_addresses}
    mine = {h.name for h in dep.hosts if ipaddress.ip_address(h.address) in local}
    if not mine:
        addrs = ", ".join(f"{h.name} {h.address}" for h in dep.hosts)
        raise UsageError(f"no host of the deployment file has an address of this machine ({addrs})",
                         hint="pass --host NAME to say which host this is")
    return mine

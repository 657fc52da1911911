"""Which address of this host its peers reach: the one rule `pdkv up` advertises by, `pdkv doctor` checks and
`pdkv bench` listens and connects by.

The rule (`advertised_candidates`, pure over an interface -> addresses table):

- an IPv4 address (vLLM's VLLM_HOST_IP and Mooncake's segment names are IPv4 here), neither loopback,
  link-local nor unspecified, of an interface that is up;
- interfaces by name, each one's addresses as the kernel lists them; the first candidate is the address
  (`advertised_address`);
- towards a known peer (`pdkv bench` against a server), the address the kernel's route to that peer leaves
  from, when it is a candidate or the peer is on loopback; else the first candidate.

No candidate is a StartError whose hint is --host-ip. The table comes from psutil (`interface_addresses`):
no sysfs or procfs file is read here.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence

from pdkv.errors import StartError

Addresses = Mapping[str, Sequence[str]]  # interface name -> its IPv4 and IPv6 addresses, without %scope


def interface_addresses(*, up_only: bool = True) -> dict[str, list[str]]:
    """This host's interfaces and their IPv4 and IPv6 addresses (without %scope), as psutil lists them; with
    `up_only`, only the interfaces that are up."""
    import psutil

    stats = psutil.net_if_stats()
    return {
        name: [a.address.split("%", 1)[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        for name, addrs in psutil.net_if_addrs().items()
        if not up_only or name not in stats or stats[name].isup
    }


def local_addresses(addrs: Addresses | None = None) -> list[str]:
    """Every address of this host's interfaces, up or not (in its network namespace), without %scope."""
    table = interface_addresses(up_only=False) if addrs is None else addrs
    return [a for items in table.values() for a in items]


def parse_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def is_candidate(address: str) -> bool:
    """Whether the rule lets pdkv advertise `address` (on an interface that is up)."""
    ip = parse_ip(address)
    return ip is not None and ip.version == 4 and not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)


def advertised_candidates(addrs: Addresses) -> list[tuple[str, str]]:
    """(interface, address) pairs peers may be told, in the rule's order (`addrs`: the interfaces that are up)."""
    return [(name, a) for name in sorted(addrs) for a in addrs[name] if is_candidate(a)]


def choose_address(addrs: Addresses, route_source: str | None = None) -> str:
    """The address peers reach: `route_source` (where the route to a known peer leaves from) when it is a
    candidate or loopback, else the first candidate. StartError when there is none."""
    if route_source is not None:
        ip = parse_ip(route_source)
        if ip is not None and (ip.is_loopback or any(a == route_source for _, a in advertised_candidates(addrs))):
            return route_source
    candidates = advertised_candidates(addrs)
    if not candidates:
        raise StartError(
            "this host has no routable IPv4 address for its peers to reach",
            hint="pass --host-ip ADDRESS (127.0.0.1 only if every part runs on this host)",
        )
    return candidates[0][1]


def route_source(peer_host: str) -> str | None:
    """The local address the kernel's route to `peer_host` leaves from (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def advertised_address(addrs: Addresses | None = None, *, towards: str | None = None) -> str:
    """The address of this host its peers reach (the rule above), read from this host unless `addrs` is given;
    `towards`: a peer's host, when one is known."""
    table = interface_addresses() if addrs is None else addrs
    return choose_address(table, route_source(towards) if towards else None)

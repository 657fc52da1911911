"""Which parts of a deployment listen beyond loopback with no deployment key: pure, for `pdkv up` and tests.

Without the key (pdkv.auth) anyone who reaches a P side channel and learns a
live transfer id can be sent that prompt's KV, and anyone who reaches a
bootstrap can register there; on loopback only this host's users can.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any


def is_loopback(host: str | None) -> bool:
    """Loopback addresses and `localhost`; unset counts as loopback (pdkv's side channel then binds 127.0.0.1)."""
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _argv_host(argv: list[str]) -> str:
    return argv[argv.index("--host") + 1] if "--host" in argv[:-1] else "127.0.0.1"


def exposure_warnings(parts: Iterable[Any], keyed: bool) -> list[str]:
    """One line per part (pdkv.deploy.plan.topology.Part) whose side channel or bootstrap is reachable beyond loopback while
    no deployment key is set; none when `keyed`."""
    if keyed:
        return []
    out: list[str] = []
    for p in parts:
        name = p.launch.name
        if p.kind == "bootstrap" and not is_loopback(_argv_host(p.launch.argv)):
            out.append(f"{name} listens on {_argv_host(p.launch.argv)} with no deployment key: anyone who reaches it may register")
        if p.kind == "prefill":
            if any(u.what == "bootstrap" and not is_loopback(u.bind) for u in p.ports):
                out.append(f"{name}'s bootstrap listens on all addresses with no deployment key: anyone who reaches it may register")
            side = getattr(p.spec, "host_ip", None)
            if not is_loopback(side):
                out.append(f"{name}'s KV side channel listens on {side} with no deployment key: whoever reaches it and learns "
                           "a live transfer id can be sent that prompt's KV")
    return out

"""Free loopback ports for the engines and servers the e2e tests start, outside the kernel's ephemeral range.

A port the kernel hands out for `bind(("127.0.0.1", 0))` lies in the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), the one every outgoing connection's source port
comes from. vLLM binds its HTTP port some 30 s after the port was picked, while other
engines open connections (ZMQ, Mooncake, gloo): one of them may take the port as its source
port meanwhile. Ports below that range are only ever taken by a bind. And a port is handed
out once per test session: two engines started together pick all their ports before either
binds one, so "free now" alone gave one engine's KV-events port to the other's HTTP server
(whose /health then never answered).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_rng = random.Random()
_given: set[int] = set()  # every port handed out by this process


def _ephemeral_start(proc_root: str = "/proc") -> int:
    try:
        return int(Path(proc_root, "sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", *, pair: bool = False) -> int:
    """A port free now on `host` below the ephemeral range; `pair`: port and port + 1 both free."""
    high = min(_ephemeral_start(), 65535) - 2
    for _ in range(1000):
        port = _rng.randrange(20000, high)
        ports = (port, port + 1) if pair else (port,)
        if not _given.intersection(ports) and all(_bindable(host, p) for p in ports):
            _given.update(ports)
            return port
    raise RuntimeError(f"no free port on {host} in 20000-{high}")


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 free (a KV-events publisher and its replay socket)."""
    return free_port(host, pair=True)

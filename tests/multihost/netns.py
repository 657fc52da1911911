"""The multihost test bed: N network namespaces joined by one bridge, each a "host" with an address in 198.18.0.0/24.

    with TestBed(["A", "B", "C"]) as hosts:
        subprocess.run(hosts[0].argv("python3", "-m", "pdkv", "up", ...))

Each namespace has `lo` up and an `eth0` (a veth whose other end is on the
bridge) with 198.18.0.<first + i>/24. The bridge has no address, so nothing
in this machine's own namespace routes to 198.18.0.0/24 and two test beds
(two runs at once) never see each other. Leaving, every process still in a
namespace is stopped (SIGTERM, then SIGKILL), then the namespaces, veths and
bridge are removed, whatever happened inside; a test bed left by a killed
run (its pid gone) is removed by the next one. Needs root and iproute2's `ip`.

`python3 tests/multihost/netns.py A B C` makes one and holds it until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

SUBNET = "198.18.0"  # RFC 2544 benchmarking range: never routed outside
PREFIX = "pdkvmh"
_NETNS = re.compile(rf"^{PREFIX}-(\d+)-(\S+)")


@dataclass(frozen=True)
class NetnsHost:
    name: str
    netns: str
    address: str

    def argv(self, *cmd: str) -> list[str]:
        """`cmd` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *cmd]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (Debian's iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _stop_processes(netns: str, grace: float = 10.0) -> None:
    """Stop every process inside `netns` (those this test bed's commands started)."""
    def pids() -> list[int]:
        out = _ip("netns", "pids", netns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + wait
        while pids() and time.monotonic() < end:
            time.sleep(0.2)


def _remove(pid: int, netns_names: list[str]) -> None:
    for ns in netns_names:
        _stop_processes(ns)
        _ip("netns", "del", ns, check=False)
    links = _ip("-o", "link", "show", check=False).stdout
    for name in re.findall(rf"^\d+: (pk{pid}v\d+|pkbr{pid})[@:]", links, re.MULTILINE):
        _ip("link", "del", name, check=False)


def remove_stale() -> None:
    """Remove the test beds of runs that are gone (killed before they could clean up)."""
    found: dict[int, list[str]] = {}
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = _NETNS.match(line)
        if m:
            found.setdefault(int(m.group(1)), []).append(line.split()[0])
    for pid, names in found.items():
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            _remove(pid, names)


class TestBed:
    """N namespaces on one bridge; a context manager that removes all of it on the way out."""

    __test__ = False  # not a pytest class

    def __init__(self, names: list[str], *, first: int = 1) -> None:
        self.pid = os.getpid()
        self.bridge = f"pkbr{self.pid}"
        self.hosts = [NetnsHost(n, f"{PREFIX}-{self.pid}-{n}", f"{SUBNET}.{first + i}") for i, n in enumerate(names)]

    def __enter__(self) -> list[NetnsHost]:
        remove_stale()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, h in enumerate(self.hosts):
                veth = f"pk{self.pid}v{i}"
                _ip("netns", "add", h.netns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self.hosts

    def close(self) -> None:
        _remove(self.pid, [h.netns for h in self.hosts if h.netns in _ip("netns", "list", check=False).stdout])

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    why = unavailable()
    if why:
        sys.exit(f"netns: {why}")
    with TestBed(sys.argv[1:] or ["A", "B"]) as made:
        for h in made:
            print(f"{h.name}: {h.address} (ip netns exec {h.netns} ...)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()

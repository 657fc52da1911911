"""Which host and boot this process is on: what the host-local transports (cma, ipc) check a peer against."""

from __future__ import annotations

import socket
from pathlib import Path


def host_id(proc_root: str | Path = "/proc") -> str:
    """This host's name and boot: two processes with the same host id can open each other's IPC handles."""
    return f"{socket.gethostname()}/{read_boot_id(proc_root) or 'unknown'}"


def read_boot_id(proc_root: str | Path = "/proc") -> str | None:
    """The kernel's boot id (new at every boot, so it tells hosts and reboots apart), or None where unreadable."""
    try:
        return Path(proc_root, "sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None

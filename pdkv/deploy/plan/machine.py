"""What this machine has that a deployment's parts depend on: GPUs, RDMA devices, addresses (read, never changed)."""

from __future__ import annotations

import glob
import os
import shutil

from pdkv import peer_address


def gpu_count() -> int:
    """How many NVIDIA GPUs this host shows, without starting CUDA."""
    devices = [d for d in glob.glob("/dev/nvidia[0-9]*") if d[len("/dev/nvidia"):].isdigit()]
    if devices:
        return len(devices)
    return 0 if shutil.which("nvidia-smi") is None else 1


def numa_nodes() -> int:
    """NUMA nodes with CPUs on this host (at least 1), from sysfs (under PDKV_SYS_ROOT when set, as `pdkv doctor`)."""
    root = os.path.join(os.environ.get("PDKV_SYS_ROOT", "/"), "sys/devices/system/node")
    count = 0
    for node in glob.glob(os.path.join(root, "node[0-9]*")):
        try:
            with open(os.path.join(node, "cpulist")) as f:
                count += bool(f.read().strip())
        except OSError:
            continue
    return max(1, count)


def rdma_devices() -> list[str]:
    return sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []


def local_addresses() -> list[str]:
    """Every address of this machine's interfaces (in its network namespace): pdkv.peer_address's table."""
    return peer_address.local_addresses()

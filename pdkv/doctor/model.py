"""What a doctor check returns, what the run is asked to do, and the host it looks at.

Every check is a function `check_x(host, options) -> CheckResult`. `Host` holds
every way a check reaches the machine (sysfs/procfs/dev through one root,
environment, NVML, network addresses, the CUDA DMA-BUF probe), so tests swap in
fixture trees and fakes for what cannot exist here (an RDMA NIC, a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Literal

import msgspec

from pdkv.bootstrap import DEFAULT_PORT
from pdkv.doctor.sysroot import SysRoot
from pdkv.errors import GpuLookupError  # noqa: F401 - exported here, where the doctor finds its types

CheckedTransport = Literal["rdma", "tcp", "cma", "socket"]  # the transports `pdkv doctor` checks a host for

# Proxy, bootstrap, and the P and D HTTP ports of docs/timeline.md's example.
DEFAULT_PORTS: tuple[int, ...] = (8000, DEFAULT_PORT, 8010, 8020)


class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


# Order of rows in the table: what needs fixing first.
STATUS_ORDER = {Status.FAIL: 0, Status.WARN: 1, Status.PASS: 2, Status.SKIP: 3}


class CheckResult(msgspec.Struct, frozen=True):
    """One verdict: `detail` says what was seen, `hint` is a one-line fix (empty when nothing to fix)."""

    name: str
    status: Status
    detail: str
    hint: str = ""


class DoctorOptions(msgspec.Struct, frozen=True):
    transport: CheckedTransport = "rdma"
    device: str | None = None
    ports: tuple[int, ...] = DEFAULT_PORTS
    skip_mooncake: bool = False
    check_timeout_s: float = 5.0
    gpu_timeout_s: float = 20.0  # NVML and cuInit wake every GPU; slow without persistence mode
    mooncake_timeout_s: float = 30.0


class DoctorReport(msgspec.Struct, frozen=True):
    ok: bool
    transport: str
    device: str | None
    sys_root: str
    elapsed_s: float
    counts: dict[str, int]
    checks: list[CheckResult]

    @property
    def failed(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status is Status.FAIL]


class GpuInfo(msgspec.Struct, frozen=True):
    index: int
    name: str
    memory_bytes: int
    pci_bus_id: str  # as NVML gives it, e.g. "00000000:18:00.0"


class GpuInventory(msgspec.Struct, frozen=True):
    gpus: list[GpuInfo]
    driver: str = ""
    cuda: str = ""


class DmabufProbe(msgspec.Struct, frozen=True):
    """What the CUDA driver says of CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, per GPU; None if it cannot say."""

    supported: list[bool] | None
    detail: str


class Host(msgspec.Struct, frozen=True):
    """The machine as the checks see it. `pdkv.doctor.runner.local_host()` builds the real one."""

    root: SysRoot
    env: Mapping[str, str]
    gpus: Callable[[], GpuInventory]
    net_addrs: Callable[[], dict[str, list[str]]]  # the interfaces that are up -> their addresses (pdkv.peer_address)
    dmabuf: Callable[[], DmabufProbe]


Check = Callable[[Host, DoctorOptions], CheckResult]

"""`pdkv doctor`: why P/D over Mooncake will or will not work on this host, and how to fix it.

One function per check (`check_<name>(host, options) -> CheckResult`), run by
`run_doctor` with a time bound each. Every sysfs, procfs and /dev read goes
through `Host.root`, a `SysRoot` set by PDKV_SYS_ROOT (default "/"; `local_host()`
builds this machine's `Host`), so the checks run unchanged against fixture trees.
"""

from pdkv.doctor.cma import cma_verdict
from pdkv.doctor.model import (
    DEFAULT_PORTS,
    CheckResult,
    DmabufProbe,
    DoctorOptions,
    DoctorReport,
    GpuInfo,
    GpuInventory,
    GpuLookupError,
    Host,
    Status,
)
from pdkv.doctor.runner import CHECKS, check_name, local_host, run_checks, run_doctor
from pdkv.doctor.software import VLLM_EXTENSIBLE_KV_CACHE, installed_vllm, installed_vllm_verdict, version_tuple
from pdkv.doctor.sysroot import SysRoot

__all__ = [
    "CHECKS",
    "CheckResult",
    "DEFAULT_PORTS",
    "DmabufProbe",
    "DoctorOptions",
    "DoctorReport",
    "GpuInfo",
    "GpuInventory",
    "GpuLookupError",
    "Host",
    "Status",
    "SysRoot",
    "VLLM_EXTENSIBLE_KV_CACHE",
    "check_name",
    "cma_verdict",
    "installed_vllm",
    "installed_vllm_verdict",
    "local_host",
    "run_checks",
    "run_doctor",
    "version_tuple",
]

"""Run every check, each in its own thread with a time bound, and gather a report.

A check that raises becomes a failed result naming the exception; one that
does not answer in time becomes a failed result and its thread is abandoned
(daemon), so the doctor always finishes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from pdkv.doctor.cma import check_cma
from pdkv.doctor.gpu import check_gpu_nic_numa, check_gpudirect_rdma, check_gpus, cuda_dmabuf_probe, nvml_gpus, once
from pdkv.doctor.host import check_alloc_conf, check_mc_env, check_memlock, check_ports
from pdkv.doctor.model import STATUS_ORDER, Check, CheckResult, DoctorOptions, DoctorReport, Host, Status
from pdkv.doctor.network import check_deployment_key, check_vllm_host_ip
from pdkv.doctor.rdma import check_rdma_device, check_rdma_devices, check_roce_gid, check_uverbs
from pdkv.doctor.socket_probe import check_socket
from pdkv.doctor.software import check_mooncake, check_vllm
from pdkv.doctor.sysroot import SysRoot
from pdkv.peer_address import interface_addresses

# In the order they are run and, within one status, listed.
CHECKS: tuple[Check, ...] = (
    check_rdma_devices,
    check_rdma_device,
    check_uverbs,
    check_gpudirect_rdma,
    check_memlock,
    check_roce_gid,
    check_gpus,
    check_gpu_nic_numa,
    check_alloc_conf,
    check_vllm_host_ip,
    check_deployment_key,
    check_mc_env,
    check_mooncake,
    check_cma,
    check_socket,
    check_vllm,
    check_ports,
)


def check_name(check: Check) -> str:
    return check.__name__.removeprefix("check_")


def time_bound(check: Check, options: DoctorOptions) -> float:
    if check is check_mooncake:
        # Its own subprocess timeout fires first; this only covers the spawn itself.
        return options.mooncake_timeout_s + 5.0
    if check in (check_gpus, check_gpudirect_rdma, check_gpu_nic_numa):
        return max(options.gpu_timeout_s, options.check_timeout_s)
    return options.check_timeout_s


def run_checks(
    options: DoctorOptions,
    host: Host,
    checks: Sequence[Check] = CHECKS,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Every check's result, in the order of `checks`; all run at once, none longer than its bound."""
    results: list[CheckResult | None] = [None] * len(checks)
    done = threading.Condition()

    def run_one(i: int, check: Check) -> None:
        try:
            result = check(host, options)
        except Exception as exc:  # noqa: BLE001 - a broken check is a finding, never a crash
            detail = f"the check itself failed: {type(exc).__name__}: {exc}"
            result = CheckResult(check_name(check), Status.FAIL, detail, "set PDKV_DEBUG=1 and report it")
        with done:
            results[i] = result
            done.notify_all()
        if on_result is not None:
            on_result(result)

    start = time.monotonic()
    for i, check in enumerate(checks):
        threading.Thread(target=run_one, args=(i, check), daemon=True, name=f"pdkv-doctor-{check_name(check)}").start()
    deadlines = [start + time_bound(c, options) for c in checks]
    with done:
        while True:
            pending = [i for i, r in enumerate(results) if r is None and time.monotonic() < deadlines[i]]
            if not pending:
                break
            done.wait(timeout=max(0.0, min(deadlines[i] for i in pending) - time.monotonic()))
        final = list(results)
    for i, check in enumerate(checks):
        if final[i] is None:
            final[i] = CheckResult(
                check_name(check),
                Status.FAIL,
                f"no answer within {time_bound(check, options):g} s (abandoned)",
                "something on this host hangs (driver, sysfs, NVML): look at dmesg",
            )
            if on_result is not None:
                on_result(final[i])
    return [r for r in final if r is not None]


def local_host(root: str | None = None, env: Mapping[str, str] | None = None) -> Host:
    """This machine as the checks see it: sysfs through `root` (default $PDKV_SYS_ROOT, else "/"), NVML, its addresses."""
    environ = dict(os.environ if env is None else env)
    return Host(
        root=SysRoot(root if root is not None else environ.get("PDKV_SYS_ROOT", "/")),
        env=environ,
        gpus=once(nvml_gpus),
        net_addrs=interface_addresses,
        dmabuf=cuda_dmabuf_probe,
    )


def run_doctor(
    options: DoctorOptions,
    host: Host | None = None,
    checks: Sequence[Check] = CHECKS,
    on_result: Callable[[CheckResult], None] | None = None,
) -> DoctorReport:
    """Run the checks on `host` (default: this machine, through PDKV_SYS_ROOT) and sort failures first."""
    host = host if host is not None else local_host()
    start = time.monotonic()
    results = run_checks(options, host, checks, on_result)
    ordered = sorted(results, key=lambda r: STATUS_ORDER[r.status])  # stable: check order within a status
    counts = {s.value: sum(r.status is s for r in results) for s in Status}
    return DoctorReport(
        ok=counts[Status.FAIL.value] == 0,
        transport=options.transport,
        device=options.device,
        sys_root=str(host.root.root),
        elapsed_s=round(time.monotonic() - start, 3),
        counts=counts,
        checks=ordered,
    )

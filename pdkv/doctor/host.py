"""Process and environment checks: memlock, the CUDA allocator config, MC_* variables, ports."""

from __future__ import annotations

import errno
import re
import socket

from pdkv.bootstrap import DEFAULT_PORT, PORT_ENV
from pdkv.doctor.model import DEFAULT_PORTS, CheckResult, DoctorOptions, Host, Status
from pdkv.doctor.rdma import skip_for_tcp

_MEMLOCK = re.compile(r"^Max locked memory\s+(\S+)\s+(\S+)", re.MULTILINE)
_CAP_IPC_LOCK = 14
# Below this, even queue pairs and completion queues fail with "Cannot allocate memory".
_MEMLOCK_FAIL_BELOW = 64 * 2**20


def parse_memlock(limits: str | None) -> tuple[int | None, int | None] | None:
    """(soft, hard) bytes of "Max locked memory" in /proc/<pid>/limits, None meaning unlimited; None if absent."""
    match = _MEMLOCK.search(limits or "")
    if not match:
        return None

    def value(text: str) -> int | None:
        return None if text == "unlimited" else int(text)

    return value(match[1]), value(match[2])


def has_cap_ipc_lock(status: str | None) -> bool:
    """True when /proc/<pid>/status shows CAP_IPC_LOCK in CapEff: the kernel then ignores the memlock limit."""
    match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status or "", re.MULTILINE)
    return bool(match) and bool(int(match[1], 16) >> _CAP_IPC_LOCK & 1)


def _size(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def check_memlock(host: Host, options: DoctorOptions) -> CheckResult:
    """RDMA registration pins memory against RLIMIT_MEMLOCK unless the process holds CAP_IPC_LOCK."""
    name = "memlock"
    if skipped := skip_for_tcp(name, options):
        return skipped
    limits = parse_memlock(host.root.read("proc/self/limits"))
    if limits is None:
        return CheckResult(name, Status.WARN, "no 'Max locked memory' line in /proc/self/limits", "check ulimit -l by hand")
    soft, hard = limits
    seen = f"soft {_size(soft)}, hard {_size(hard)}"
    if soft is None:
        return CheckResult(name, Status.PASS, f"max locked memory {seen}")
    if has_cap_ipc_lock(host.root.read("proc/self/status")):
        return CheckResult(name, Status.PASS, f"max locked memory {seen}, but CAP_IPC_LOCK is held: the limit is not enforced")
    raise_it = (
        "ulimit -l unlimited" if hard is None else "raise the hard limit (docker --ulimit memlock=-1:-1; systemd LimitMEMLOCK=infinity)"
    )
    fix = f"{raise_it}, in the shell or unit that starts vLLM"
    if soft < _MEMLOCK_FAIL_BELOW:
        return CheckResult(name, Status.FAIL, f"max locked memory {seen}: RDMA setup fails with 'Cannot allocate memory'", fix)
    return CheckResult(name, Status.WARN, f"max locked memory {seen}: host-memory KV larger than this cannot be registered", fix)


def parse_alloc_conf(text: str) -> dict[str, str]:
    """PyTorch's "key:value,key:value" allocator settings as a dict."""
    pairs = (item.split(":", 1) for item in text.split(",") if ":" in item)
    return {k.strip(): v.strip() for k, v in pairs}


def check_alloc_conf(host: Host, options: DoctorOptions) -> CheckResult:
    """expandable_segments maps KV through cuMemMap pieces that RDMA registration cannot pin."""
    name = "alloc_conf"
    found = {var: host.env[var] for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if var in host.env}
    if not found:
        return CheckResult(name, Status.PASS, "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset")
    expandable = [var for var, val in found.items() if parse_alloc_conf(val).get("expandable_segments", "").lower() in ("true", "1")]
    seen = ", ".join(f"{k}={v}" for k, v in found.items())
    if not expandable:
        return CheckResult(name, Status.PASS, seen)
    if options.transport != "rdma":
        return CheckResult(name, Status.PASS, f"{seen} (expandable segments only break RDMA registration)")
    return CheckResult(
        name,
        Status.FAIL,
        f"{seen}: expandable segments break RDMA registration of the KV cache",
        f"drop expandable_segments:True from {expandable[0]} in the engine's environment",
    )


_MC_INTEGERS = ("MC_GID_INDEX", "MC_IB_PORT", "MC_HANDSHAKE_PORT", "MC_NUM_QP_PER_EP", "MC_MAX_EP_PER_CTX", "MC_SLICE_SIZE")
_MC_MTUS = ("512", "1024", "2048", "4096")


def check_mc_env(host: Host, options: DoctorOptions) -> CheckResult:
    """Report Mooncake's MC_* variables; they are read once, when the TransferEngine starts."""
    name = "mc_env"
    mc = {k: v for k, v in sorted(host.env.items()) if k.startswith("MC_")}
    if not mc:
        return CheckResult(name, Status.PASS, "no MC_* variables set (Mooncake defaults)")
    seen = ", ".join(f"{k}={v}" for k, v in mc.items())
    bad = [k for k in _MC_INTEGERS if k in mc and not mc[k].strip().isdigit()]
    if "MC_MTU" in mc and mc["MC_MTU"].strip() not in _MC_MTUS:
        bad.append("MC_MTU")
    if bad:
        hint = f"fix {bad[0]} (an integer; MC_MTU one of {'/'.join(_MC_MTUS)})"
        return CheckResult(name, Status.FAIL, f"{seen}: invalid {', '.join(bad)}", hint)
    if options.transport == "rdma" and mc.get("MC_FORCE_TCP", "").lower() in ("1", "true", "yes", "on"):
        return CheckResult(name, Status.WARN, f"{seen}: MC_FORCE_TCP makes Mooncake use TCP despite rdma", "unset MC_FORCE_TCP")
    return CheckResult(name, Status.PASS, f"{seen} (they act only if set before the engine starts)")


def deployment_ports(host: Host, options: DoctorOptions) -> tuple[int, ...]:
    """The ports to probe: --port values, else the defaults with the bootstrap port from VLLM_MOONCAKE_BOOTSTRAP_PORT."""
    if options.ports != DEFAULT_PORTS:
        return options.ports
    bootstrap = host.env.get(PORT_ENV, "")
    if bootstrap.isdigit():
        return tuple(int(bootstrap) if p == DEFAULT_PORT else p for p in DEFAULT_PORTS)
    return DEFAULT_PORTS


def port_free(port: int, host: str = "0.0.0.0") -> OSError | None:
    """None if a server could listen on host:port now, else the error binding it gave."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # The servers set SO_REUSEADDR too, so a port in TIME_WAIT is not reported busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            return exc
    return None


def _holder(port: int) -> str:
    """Who listens on the port, where psutil may say."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return f" by pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except Exception:  # noqa: BLE001 - who holds the port is a nicety; permissions often forbid it
        pass
    return ""


def check_ports(host: Host, options: DoctorOptions) -> CheckResult:
    name = "ports"
    ports = deployment_ports(host, options)
    if not ports:
        return CheckResult(name, Status.SKIP, "no ports to check")
    busy, denied = [], []
    for port in ports:
        error = port_free(port)
        if error is None:
            continue
        in_use = error.errno == errno.EADDRINUSE
        (busy if in_use else denied).append(f"{port}" + (_holder(port) if in_use else f" ({error.strerror})"))
    if busy:
        return CheckResult(
            name,
            Status.FAIL,
            f"in use: {', '.join(busy)}",
            f"stop what listens there (ss -ltnp 'sport = :{busy[0].split()[0]}') or give the deployment other ports",
        )
    if denied:
        return CheckResult(name, Status.WARN, f"cannot bind: {', '.join(denied)}", "use ports above 1023 or run with the needed privilege")
    return CheckResult(name, Status.PASS, f"free: {', '.join(map(str, ports))}")

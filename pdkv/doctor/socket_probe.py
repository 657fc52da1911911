"""The socket check: can D's listener bind the address this host advertises, and does a write over it land?"""

from __future__ import annotations

import ctypes
import time

from pdkv.doctor.model import CheckResult, DoctorOptions, Host, Status
from pdkv.errors import PdkvError

PROBE_BYTES = 4 << 20


def probe_socket(host_ip: str, timeout_s: float) -> tuple[bool, str]:
    """Open the socket transport as D (listening on `host_ip`) and as P, write PROBE_BYTES across, compare."""
    from pdkv.transport import Descriptor, open_transport

    src = (ctypes.c_ubyte * PROBE_BYTES).from_buffer_copy(bytes([0x5A]) * PROBE_BYTES)
    dst = (ctypes.c_ubyte * PROBE_BYTES)()
    a, b = ctypes.addressof(src), ctypes.addressof(dst)
    try:
        with open_transport("socket", host_ip, write_timeout_s=timeout_s) as d, \
                open_transport("socket", host_ip, writable=False, write_timeout_s=timeout_s) as p:
            d.register([(b, PROBE_BYTES)])
            p.register([(a, PROBE_BYTES)])
            d.expect("doctor", [(b, PROBE_BYTES)])
            t0 = time.perf_counter()
            p.write(d.session_address, [Descriptor(a, b, PROBE_BYTES)], transfer="doctor")
            ms = (time.perf_counter() - t0) * 1e3
    except PdkvError as exc:
        return False, exc.message
    if bytes(dst) != bytes(src):
        return False, "the bytes that arrived differ from those sent"
    return True, f"D's listener on {host_ip} took a {PROBE_BYTES >> 20} MiB write in {ms:.1f} ms (connect and handshake included)"


def check_socket(host: Host, options: DoctorOptions) -> CheckResult:
    name = "socket"
    if options.transport != "socket":
        return CheckResult(name, Status.SKIP, f"transport {options.transport} does not use pdkv's socket transport")
    host_ip = host.env.get("VLLM_HOST_IP") or "127.0.0.1"
    ok, detail = probe_socket(host_ip, options.check_timeout_s)
    fix = "" if ok else "set VLLM_HOST_IP to an address of this host that P can reach, and let TCP through to D's socket_port"
    return CheckResult(name, Status.PASS if ok else Status.FAIL, detail, fix)

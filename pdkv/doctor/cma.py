"""The cma check: can a process of this host write into another's memory, as P does into D's with `--transport cma`?"""

from __future__ import annotations

import subprocess
import sys
import time

from pdkv.doctor.model import CheckResult, DoctorOptions, Host, Status

# A stand-in for D: zeroed memory, its session address and address on stdout, then (after the parent's
# write) whether every byte holds the value written. It opens the transport as D's worker does.
_TARGET = r"""
import ctypes, sys
from pdkv.transport import open_transport
n = int(sys.argv[1])
buf = (ctypes.c_ubyte * n)()
t = open_transport("cma")
print(t.session_address, ctypes.addressof(buf), flush=True)
sys.stdin.readline()
print("ok" if bytes(buf) == bytes([0x5A]) * n else "wrong", flush=True)
"""
PROBE_BYTES = 1 << 20
FIX = "run P and D as one user in one pid namespace (in containers, let seccomp allow process_vm_writev), or use --transport tcp"


def probe_cma(timeout_s: float) -> tuple[bool, str]:
    """Write PROBE_BYTES into a child process with the cma transport and have the child check them."""
    import ctypes

    from pdkv.errors import PdkvError
    from pdkv.transport import Descriptor, open_transport

    child = subprocess.Popen(
        [sys.executable, "-c", _TARGET, str(PROBE_BYTES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = child.stdout.readline().split() if child.stdout else []
        if len(line) != 2:
            child.kill()
            err = (child.stderr.read() if child.stderr else "").strip().splitlines()
            return False, f"the probe process did not start: {err[-1] if err else 'no output'}"
        session, addr = line[0], int(line[1])
        src = (ctypes.c_ubyte * PROBE_BYTES).from_buffer_copy(bytes([0x5A]) * PROBE_BYTES)
        try:
            with open_transport("cma", writable=False) as t:
                t.register([(ctypes.addressof(src), PROBE_BYTES)])
                t0 = time.perf_counter()
                t.write(session, [Descriptor(ctypes.addressof(src), addr, PROBE_BYTES)])
                ms = (time.perf_counter() - t0) * 1e3
        except PdkvError as exc:
            return False, exc.message
        out, _ = child.communicate("go\n", timeout=timeout_s)
        if out.strip() != "ok":
            return False, f"the probe process found other bytes than were written ({out.strip() or 'no answer'})"
        return True, f"process_vm_writev moved {PROBE_BYTES >> 20} MiB into a child process in {ms:.2f} ms, bytes verified"
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(5)


def cma_verdict(scope: int | None, timeout_s: float) -> tuple[bool, str, str]:
    """(works, what was seen, how to fix it) for cma on this host, given Yama's ptrace_scope (None: no Yama)."""
    if scope is not None and scope >= 2:
        return (
            False,
            f"kernel.yama.ptrace_scope is {scope}: no process may write into another's memory without CAP_SYS_PTRACE",
            "sysctl -w kernel.yama.ptrace_scope=1 (pdkv's D then lets processes of its user write into it), or use --transport tcp",
        )
    ok, detail = probe_cma(timeout_s)
    if not ok:
        return False, detail, FIX
    if scope == 1:
        detail += "; Yama ptrace_scope 1: D lets processes of its user write into it"
    return True, detail, ""


def check_cma(host: Host, options: DoctorOptions) -> CheckResult:
    name = "cma"
    if options.transport != "cma":
        return CheckResult(name, Status.SKIP, f"transport {options.transport} does not write into another process's memory")
    text = host.root.read("proc/sys/kernel/yama/ptrace_scope")
    ok, detail, fix = cma_verdict(int(text) if text and text.isdigit() else None, options.check_timeout_s)
    return CheckResult(name, Status.PASS if ok else Status.FAIL, detail, fix)

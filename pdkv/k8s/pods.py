"""What a P/D pod needs, piece by piece: labels, GPU and RDMA resources, the pod-IP environment,
declared ports, health probes, the doctor init container, P/D anti-affinity, the pod spec around them.

Pure: each function returns plain dicts in the Kubernetes API's shape.
"""

from __future__ import annotations

import math
import shlex
from typing import Any, Literal

import msgspec

from pdkv import __version__
from pdkv.errors import ConfigError
from pdkv.deploy import KubernetesEntry
from pdkv.k8s.settings import MOONCAKE_PORTS_PER_GPU

Role = Literal["bootstrap", "prefill", "decode", "proxy", "config"]
ROLE_LABEL = "pdkv/role"
PART_LABEL = "pdkv/part"
HOST_IP_ENV = "VLLM_HOST_IP"  # what vLLM and pdkv's connector advertise (side channel, Mooncake session)
ADVERTISE_ENV = "PDKV_ADVERTISE_URL"  # the engine's own URL in its member record
MEMBERS_ENV = "PDKV_MEMBERS_URL"  # the members registry the engine registers with
KV_CONFIG_ENV = "PDKV_KV_TRANSFER_CONFIG"  # the ConfigMap's kv-transfer-config, expanded into vLLM's argv
SHM_VOLUME = "dshm"
MODEL_VOLUME = "models"
HEALTH_PATH = "/health"


class Layout(msgspec.Struct, frozen=True):
    """How one engine instance's TP ranks sit on pods: `nodes` pods of `gpus` GPUs (a LeaderWorkerSet when nodes > 1)."""

    nodes: int
    gpus: int
    ranks: int  # TP ranks per pod


def engine_layout(tp: int, k: KubernetesEntry, *, gpu: bool, label: str, source: str) -> Layout:
    """One pod when TP fits a node (and divides its GPUs), else tp / gpus_per_node pods of a whole node each."""
    if tp < 1:
        raise ConfigError(f"{source}: {label} has tp = {tp}", hint="write 1 or more")
    if not gpu:
        return Layout(nodes=1, gpus=0, ranks=tp)
    per_node = k.gpus_per_node
    if tp <= per_node:
        if per_node % tp:
            raise ConfigError(f"{source}: {label} has tp = {tp}, which does not divide gpus_per_node = {per_node}",
                              hint=f"use a TP that divides {per_node} (or set [kubernetes] gpus_per_node to the nodes' GPU count)")
        return Layout(nodes=1, gpus=tp, ranks=tp)
    if tp % per_node:
        raise ConfigError(f"{source}: {label} has tp = {tp} across nodes of {per_node} GPUs, which {per_node} does not divide",
                          hint=f"use a multiple of {per_node}, so every node holds {per_node} ranks")
    return Layout(nodes=tp // per_node, gpus=per_node, ranks=per_node)


def labels(k: KubernetesEntry, role: Role, part: str) -> dict[str, str]:
    """Every object's and pod's labels: the recommended app.kubernetes.io set plus pdkv's role and part."""
    return {
        "app.kubernetes.io/name": "pdkv",
        "app.kubernetes.io/instance": k.name,
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/version": __version__,
        "app.kubernetes.io/managed-by": "pdkv",
        ROLE_LABEL: role,
        PART_LABEL: part,
    }


def selector(k: KubernetesEntry, part: str) -> dict[str, str]:
    """The labels that pick one part's pods (a subset of `labels`, stable across pdkv versions)."""
    return {"app.kubernetes.io/name": "pdkv", "app.kubernetes.io/instance": k.name, PART_LABEL: part}


def resources(k: KubernetesEntry, gpus: int, rdma: bool) -> dict[str, Any]:
    """Extended resources (GPUs, the RDMA device plugin's) in requests and limits alike, as Kubernetes asks of them."""
    want: dict[str, str] = {}
    if gpus:
        want[k.gpu_resource] = str(gpus)
    if rdma:
        want[k.rdma_resource] = str(k.rdma_per_pod)
    return {"requests": dict(want), "limits": dict(want)} if want else {}


def pod_ip_env() -> dict[str, Any]:
    return {"name": HOST_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def token_env(k: KubernetesEntry) -> list[dict[str, Any]]:
    """The deployment key from the operator's Secret, in the variable every pdkv part reads (docs/security.md)."""
    from pdkv.bootstrap import TOKEN_ENV

    if k.token_secret is None:
        return []
    return [{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": k.token_secret, "key": k.token_key}}}]


def mooncake_env(k: KubernetesEntry, ranks: int) -> list[dict[str, Any]]:
    low, high = mooncake_range(k, ranks)
    return [{"name": "MC_MIN_RPC_PORT", "value": str(low)}, {"name": "MC_MAX_RPC_PORT", "value": str(high)}]


def mooncake_range(k: KubernetesEntry, ranks: int) -> tuple[int, int]:
    """Mooncake's port range for a pod of `ranks` TP ranks: each TransferEngine takes its RPC and tcp ports in it."""
    return k.mooncake_port, k.mooncake_port + MOONCAKE_PORTS_PER_GPU * max(ranks, 1) - 1


def port(name: str, number: int) -> dict[str, Any]:
    return {"name": name, "containerPort": number, "protocol": "TCP"}


def mooncake_ports(k: KubernetesEntry, ranks: int) -> list[dict[str, Any]]:
    low, high = mooncake_range(k, ranks)
    return [port(f"mooncake-{i}", p) for i, p in enumerate(range(low, high + 1))]


def engine_probes(startup_timeout: float) -> dict[str, Any]:
    """Startup (as long as `pdkv up` waits for the engine), readiness and liveness on vLLM's /health."""
    get = {"path": HEALTH_PATH, "port": "http"}
    return {
        "startupProbe": {"httpGet": get, "periodSeconds": 10, "timeoutSeconds": 5,
                         "failureThreshold": max(1, math.ceil(startup_timeout / 10))},
        "readinessProbe": {"httpGet": get, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "livenessProbe": {"httpGet": get, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def security_context() -> dict[str, Any]:
    # IPC_LOCK: the RDMA NIC pins (mlock) the registered KV memory.
    return {"capabilities": {"add": ["IPC_LOCK"]}}


def engine_mounts(k: KubernetesEntry) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    if k.model_pvc:
        mounts.append({"name": MODEL_VOLUME, "mountPath": k.model_mount, "readOnly": True})
    return mounts


def engine_volumes(k: KubernetesEntry) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}}]
    if k.model_pvc:
        volumes.append({"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": k.model_pvc, "readOnly": True}})
    return volumes


def doctor_container(k: KubernetesEntry, transport: str, device: str, ports: list[int], res: dict[str, Any]) -> dict[str, Any]:
    """`pdkv doctor` before the engine: exit 4 on a node that cannot do this transport, its error line the pod's reason.

    stderr (the one-line "pdkv: error: ..." and its hint) goes to the termination log, which Kubernetes shows as the
    init container's message (`kubectl describe pod`); the check table stays in the container's log.
    """
    argv = ["pdkv", "doctor", "--transport", transport]
    if device:
        argv += ["--device", device]
    for p in ports:
        argv += ["--port", str(p)]
    container: dict[str, Any] = {
        "name": "doctor",
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "command": ["sh", "-c", f"exec {shlex.join(argv)} 2>/dev/termination-log"],
        "securityContext": security_context(),
    }
    if res:
        container["resources"] = res  # the same devices the engine gets: the device plugin hands them on
    return container


def anti_affinity(k: KubernetesEntry, role: Role) -> dict[str, Any] | None:
    """Keep a P pod off the nodes of D pods (and the other way round), preferred or required; None when off."""
    other = {"prefill": "decode", "decode": "prefill"}.get(role)
    if k.anti_affinity == "none" or other is None:
        return None
    term = {
        "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": k.name, ROLE_LABEL: other}},
        "topologyKey": "kubernetes.io/hostname",
    }
    if k.anti_affinity == "required":
        return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}}


def pod_spec(
    k: KubernetesEntry,
    containers: list[dict[str, Any]],
    *,
    role: Role,
    init: list[dict[str, Any]] | None = None,
    engine: bool = False,
) -> dict[str, Any]:
    """The spec around the containers. Service links are off: a Service named like an env var prefix
    (vllm -> VLLM_PORT=tcp://...) would otherwise inject variables vLLM misreads."""
    spec: dict[str, Any] = {"enableServiceLinks": False, "terminationGracePeriodSeconds": k.grace_period_s}
    if k.service_account:
        spec["serviceAccountName"] = k.service_account
    if k.node_selector and role in ("prefill", "decode"):
        spec["nodeSelector"] = dict(k.node_selector)
    affinity = anti_affinity(k, role)
    if affinity:
        spec["affinity"] = affinity
    if init:
        spec["initContainers"] = init
    spec["containers"] = containers
    if engine:
        spec["volumes"] = engine_volumes(k)
    return spec

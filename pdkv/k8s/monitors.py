"""What the Prometheus Operator scrapes of a deployment (`[kubernetes] monitors = true`; its CRDs must be installed):

    PodMonitor      <name>-engines    every prefill and decode pod's `http` port: vLLM's and pdkv's connector's /metrics
    ServiceMonitor  <name>-services   the proxy's (`http`) and the bootstrap's (`bootstrap`) Services

Each target's `job` is pdkv-<role> (pdkv-prefill, pdkv-decode, pdkv-proxy, pdkv-bootstrap), the jobs that the
rules and the dashboard in monitoring/ select on, and `part` names its table (prefill-0, decode-1, proxy, ...).
A LeaderWorkerSet's worker pods serve no HTTP port, so only its leader is scraped. A proxy with an admin key needs
an `authorization` block added to the ServiceMonitor's `http` endpoint (docs/k8s.md).
"""

from __future__ import annotations

from typing import Any

from pdkv.deploy import Deployment
from pdkv.k8s import pods

MONITORING_API = "monitoring.coreos.com/v1"
ENGINE_ROLES = ("prefill", "decode")
SERVICE_PORTS = {"proxy": "http", "bootstrap": "bootstrap"}


def _meta_label(kind: str, label: str) -> str:
    """The label Prometheus' Kubernetes discovery gives a pod's or a Service's label (every other character: `_`)."""
    return f"__meta_kubernetes_{kind}_label_" + "".join(c if c.isalnum() else "_" for c in label)


def _relabelings(kind: str) -> list[dict[str, Any]]:
    return [
        {"sourceLabels": [_meta_label(kind, pods.ROLE_LABEL)], "targetLabel": "job", "replacement": "pdkv-$1", "action": "replace"},
        {"sourceLabels": [_meta_label(kind, pods.PART_LABEL)], "targetLabel": "part", "action": "replace"},
    ]


def _selector(dep: Deployment, roles: list[str]) -> dict[str, Any]:
    k = dep.kubernetes
    return {"matchLabels": {"app.kubernetes.io/name": "pdkv", "app.kubernetes.io/instance": k.name},
            "matchExpressions": [{"key": pods.ROLE_LABEL, "operator": "In", "values": roles}]}  # fmt: skip


def monitor_objects(dep: Deployment, ns: str) -> list[dict[str, Any]]:
    """The PodMonitor of the engines and the ServiceMonitor of the proxy and the bootstrap (none unless asked)."""
    k = dep.kubernetes
    if not k.monitors:
        return []
    labels = pods.labels(k, "monitoring", "monitoring")
    objects: list[dict[str, Any]] = [{
        "apiVersion": MONITORING_API, "kind": "PodMonitor",
        "metadata": {"name": f"{k.name}-engines", "namespace": ns, "labels": labels},
        "spec": {
            "selector": _selector(dep, list(ENGINE_ROLES)),
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "relabelings": _relabelings("pod")}],
        },
    }]
    services = [role for role in SERVICE_PORTS if role != "bootstrap" or not (dep.bootstrap.mode == "external" and dep.bootstrap.url)]
    services = [role for role in services if role != "proxy" or dep.proxy is not None]
    if services:
        objects.append({
            "apiVersion": MONITORING_API, "kind": "ServiceMonitor",
            "metadata": {"name": f"{k.name}-services", "namespace": ns, "labels": labels},
            "spec": {
                "selector": _selector(dep, services),
                "endpoints": [
                    {"port": SERVICE_PORTS[role], "path": "/metrics", "relabelings": _relabelings("service")} for role in services
                ],
            },
        })
    return objects

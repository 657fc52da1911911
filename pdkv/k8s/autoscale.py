"""The file's `[autoscale]` table on Kubernetes: one autoscaler per role on the planner's gauge (pure).

    kubernetes = "hpa"   HorizontalPodAutoscaler (autoscaling/v2) per role, on the External metric
                         pdkv_planner_desired_engines{role} that the Prometheus adapter serves (`adapter_rules`)
    kubernetes = "keda"  ScaledObject (keda.sh/v1alpha1) per role, a `prometheus` trigger querying `prometheus_url`

Each scales its role's one workload (the Deployment, or the LeaderWorkerSet when TP spans nodes: both have
the scale subresource) between the role's min and max. The target is one engine per unit of the gauge
(AverageValue 1), so the replicas the autoscaler asks for are the count the planner asks for.

The planner's gauge already carries its hysteresis: it rises after `up_after_s` and falls only once a
smaller count has sufficed for `down_after_s`, to the highest count that sufficed over that wait, which is
the HPA's own scale-down rule. So the autoscaler follows the gauge as it stands: no stabilization window
of its own (the HPA's default, 300 s, would hold engines past the file's `down_after_s`; a window of
`down_after_s` would hold them twice as long) and policies that take any step within the bounds at once.
"""

from __future__ import annotations

from typing import Any, get_args
from urllib.parse import urlsplit

from pdkv.deploy import AutoscaleEntry, AutoscalerKind, Deployment, RoleBounds
from pdkv.errors import ConfigError
from pdkv.k8s import pods

METRIC = "pdkv_planner_desired_engines"  # pdkv.planner.gauges exports it with a `role` label
KINDS: tuple[str, ...] = get_args(AutoscalerKind)  # "hpa", "keda"
ROLES = ("prefill", "decode")
KEDA_API = "keda.sh/v1alpha1"
# The HPA controller's sync period (kube-controller-manager --horizontal-pod-autoscaler-sync-period, 15 s by default).
HPA_PERIOD_S = 15


def _bounds(a: AutoscaleEntry, role: str) -> RoleBounds:
    return a.prefill if role == "prefill" else a.decode


def check_autoscale(dep: Deployment, *, source: str) -> None:
    """Raise ConfigError (one line) for an `[autoscale]` table Kubernetes could not act on; nothing without one.

    The loader checks the same bounds; this also guards a Deployment built in code, and adds what only
    Kubernetes asks: an autoscaler scales one workload, so each role is one [[prefill]]/[[decode]] table.
    """
    a = dep.autoscale
    if a is None:
        return
    if a.kubernetes not in KINDS:
        raise ConfigError(f"{source}: [autoscale] kubernetes = {a.kubernetes!r} is not an autoscaler pdkv renders",
                          hint='write "hpa" (a HorizontalPodAutoscaler through the Prometheus adapter) or "keda" (a KEDA ScaledObject)')
    for role in ROLES:
        b = _bounds(a, role)
        if not 1 <= b.min <= b.max:
            raise ConfigError(f"{source}: [autoscale.{role}] needs 1 <= min <= max, got min = {b.min}, max = {b.max}")
        tables = len(dep.prefill if role == "prefill" else dep.decode)
        if tables == 0:
            raise ConfigError(f"{source}: [autoscale] scales {role}, and the file has no [[{role}]] table",
                              hint=f"add one [[{role}]] table: the workload the autoscaler scales")
        if tables > 1:
            raise ConfigError(f"{source}: [autoscale.{role}] scales one workload, and the file has {tables} [[{role}]] tables",
                              hint=f"write one [[{role}]] table (the autoscaler sets its replicas), or drop [autoscale]")
    if a.kubernetes == "keda":
        url = urlsplit(a.prometheus_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(f"{source}: [autoscale] prometheus_url = {a.prometheus_url!r} is not an http(s) URL",
                              hint='the Prometheus server KEDA queries, e.g. "http://prometheus-operated.monitoring.svc:9090"')


def query(role: str, namespace: str) -> str:
    """PromQL for one role's desired count. `max` over the proxies: each proxy replica exports the gauge, and an
    autoscaler adds up every series it is given. The namespace keeps other namespaces' proxies out."""
    return f'max({METRIC}{{namespace="{namespace}",role="{role}"}})'


def behavior(b: RoleBounds) -> dict[str, Any]:
    """Follow the gauge: no window of the autoscaler's own (the gauge holds the hysteresis), any step in one period."""
    step = [{"type": "Pods", "value": b.max, "periodSeconds": HPA_PERIOD_S}]
    return {
        "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max", "policies": step},
        "scaleDown": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max", "policies": step},
    }


def _meta(workload: dict[str, Any]) -> dict[str, Any]:
    md = workload["metadata"]
    return {"name": md["name"], "namespace": md["namespace"], "labels": dict(md["labels"])}


def _target(workload: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": workload["apiVersion"], "kind": workload["kind"], "name": workload["metadata"]["name"]}


def _hpa(workload: dict[str, Any], role: str, b: RoleBounds) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": _meta(workload),
        "spec": {
            "scaleTargetRef": _target(workload),
            "minReplicas": b.min, "maxReplicas": b.max,
            # The adapter adds the HPA's namespace to the selector (adapter_rules: namespaced).
            "metrics": [{"type": "External", "external": {
                "metric": {"name": METRIC, "selector": {"matchLabels": {"role": role}}},
                "target": {"type": "AverageValue", "averageValue": "1"},
            }}],
            "behavior": behavior(b),
        },
    }


def _scaled_object(workload: dict[str, Any], role: str, b: RoleBounds, a: AutoscaleEntry) -> dict[str, Any]:
    ns = workload["metadata"]["namespace"]
    return {
        "apiVersion": KEDA_API, "kind": "ScaledObject", "metadata": _meta(workload),
        "spec": {
            "scaleTargetRef": _target(workload),
            "minReplicaCount": b.min, "maxReplicaCount": b.max,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior(b)}},
            "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
                "serverAddress": a.prometheus_url,
                "query": query(role, ns),
                "threshold": "1",
                # KEDA reads an empty answer as 0 unless told otherwise: a proxy not scraped would scale the role to min.
                "ignoreNullValues": "false",
            }}],
        },
    }


def autoscaler_objects(dep: Deployment, workloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One autoscaler per role for the rendered engine `workloads` (each labelled with its role), named as its
    workload; none without `[autoscale]`. `check_autoscale` has passed."""
    a = dep.autoscale
    if a is None:
        return []
    objects = []
    for role in ROLES:
        (workload,) = [w for w in workloads if w["metadata"]["labels"][pods.ROLE_LABEL] == role]
        b = _bounds(a, role)
        objects.append(_hpa(workload, role, b) if a.kubernetes == "hpa" else _scaled_object(workload, role, b, a))
    return objects


def adapter_rules() -> dict[str, Any]:
    """The Prometheus adapter's rule serving the gauge as an External metric (its config file's `externalRules`;
    the Helm chart's `rules.external`). The same for every pdkv deployment: the adapter adds the HPA's namespace
    to the labels it matches, and the HPA selects the role."""
    return {"externalRules": [{
        "seriesQuery": f'{METRIC}{{namespace!="",role!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
        "name": {"matches": f"^{METRIC}$", "as": METRIC},
        "metricsQuery": "max(<<.Series>>{<<.LabelMatchers>>})",
    }]}

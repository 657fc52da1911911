"""Helpers the Kubernetes tests share: render a file, walk the pod templates, validate against the schemas.

Core kinds go through `kubernetes-validate` (its strict schemas refuse unknown fields; a HorizontalPodAutoscaler
is one: autoscaling/v2); a LeaderWorkerSet through the LWS CRD's openAPIV3Schema (tests/fixtures/k8s/), made
strict the same way, and its two pod templates through the core PodTemplate schema as well; a KEDA ScaledObject
through a schema written by hand from KEDA's CRD and its prometheus scaler (tests/fixtures/k8s/, the file
says which), and the HPA behavior it carries through the HorizontalPodAutoscaler schema as well; a PodMonitor and
a ServiceMonitor through schemas written by hand from the Prometheus Operator's CRDs (tests/fixtures/k8s/, likewise).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CRD = ROOT / "tests" / "fixtures" / "k8s" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
KEDA_SCHEMA = ROOT / "tests" / "fixtures" / "k8s" / "keda.sh_scaledobjects.handwritten.schema.yaml"
MONITOR_SCHEMAS = ROOT / "tests" / "fixtures" / "k8s" / "monitoring.coreos.com_monitors.handwritten.schema.yaml"

DEPLOYMENT = """model = "/models/Qwen3-8B"
device = "mlx5_0"
{top}
{tables}
[[prefill]]
port = 8010
{prefill}
[[decode]]
port = 8020
{decode}
[kubernetes]
{kubernetes}
"""


def deployment_text(prefill: str = "", decode: str = "", kubernetes: str = "", top: str = "block_size = 16", tables: str = "") -> str:
    """A one-P, one-D deployment file for `pdkv k8s render`, with the given lines in each table (`kubernetes` may
    end with tables of its own, such as `[autoscale]`)."""
    return DEPLOYMENT.format(prefill=prefill, decode=decode, kubernetes=kubernetes, top=top, tables=tables)
K8S_VERSIONS = ("1.30", "1.33", "1.37")


def render_file(path: Path, **kw: Any) -> list[dict[str, Any]]:
    from pdkv.deploy.plan.loader import load_deployment
    from pdkv.k8s.render import render

    return render(load_deployment(path), source=str(path), **kw)


def render_text(tmp_path: Path, text: str, **kw: Any) -> list[dict[str, Any]]:
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    return render_file(path, **kw)


def pod_templates(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], str, dict[str, Any]]]:
    """(object, "pod" | "leader" | "worker", pod template) for every workload."""
    for obj in objects:
        if obj["kind"] == "Deployment":
            yield obj, "pod", obj["spec"]["template"]
        elif obj["kind"] == "LeaderWorkerSet":
            lwt = obj["spec"]["leaderWorkerTemplate"]
            yield obj, "leader", lwt["leaderTemplate"]
            yield obj, "worker", lwt["workerTemplate"]


def _strict(schema: Any) -> Any:
    """The schema with additionalProperties: false on every object that lists its properties (as kubernetes-validate's strict)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def lws_crd_version() -> dict[str, Any]:
    """The LWS CRD's `v1` entry: its openAPIV3Schema and its subresources (scale, status)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD.read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert crd["spec"]["group"] == "leaderworkerset.x-k8s.io"
    return version


@cache
def lws_schema() -> dict[str, Any]:
    return _strict(lws_crd_version()["schema"]["openAPIV3Schema"])


def validate_lws(obj: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.Draft7Validator(lws_schema()).validate(obj)


@cache
def keda_schema() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(KEDA_SCHEMA.read_text())


def validate_scaled_object(obj: dict[str, Any], version: str) -> None:
    import jsonschema
    import kubernetes_validate

    jsonschema.Draft7Validator(keda_schema()).validate(obj)
    spec = obj["spec"]
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior is not None:  # KEDA hands it to the HorizontalPodAutoscaler it creates
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": obj["metadata"]["name"]},
               "spec": {"scaleTargetRef": spec["scaleTargetRef"], "maxReplicas": spec.get("maxReplicaCount", 100), "behavior": behavior}}
        kubernetes_validate.validate(copy.deepcopy(hpa), version, strict=True)


@cache
def monitor_schemas() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(MONITOR_SCHEMAS.read_text())


def validate_monitor(obj: dict[str, Any]) -> None:
    """A PodMonitor or ServiceMonitor against the schema written from the Prometheus Operator's CRD."""
    import jsonschema

    schemas = monitor_schemas()
    jsonschema.Draft7Validator({**schemas[obj["kind"]], "definitions": schemas["definitions"]}).validate(obj)


def validate(obj: dict[str, Any], version: str) -> None:
    """Raise on the first schema error of `obj` (a core kind, a LeaderWorkerSet, a ScaledObject, a PodMonitor or a
    ServiceMonitor) for Kubernetes `version`."""
    import kubernetes_validate

    if obj["kind"] == "ScaledObject":
        validate_scaled_object(obj, version)
        return
    if obj["kind"] in ("PodMonitor", "ServiceMonitor"):
        validate_monitor(obj)
        return
    if obj["kind"] != "LeaderWorkerSet":
        kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
        return
    validate_lws(obj)
    for _, _, template in pod_templates([obj]):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": obj["metadata"]["name"]}, "template": template}
        kubernetes_validate.validate(wrapped, version, strict=True)


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    return template["spec"]["containers"]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None

"""Helpers the Kubernetes tests share: render a file, walk the pod templates, validate against the schemas.

Core kinds go through `kubernetes-validate` (its strict schemas refuse unknown fields); a LeaderWorkerSet
through the LWS CRD's openAPIV3Schema (tests/fixtures/k8s/), made strict the same way, and its two pod
templates through the core PodTemplate schema as well.
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
K8S_VERSIONS = ("1.30", "1.33", "1.37")


def render_file(path: Path, **kw: Any) -> list[dict[str, Any]]:
    from pdkv.deploy.loader import load_deployment
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
def lws_schema() -> dict[str, Any]:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD.read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(version["schema"]["openAPIV3Schema"])


def validate_lws(obj: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.Draft7Validator(lws_schema()).validate(obj)


def validate(obj: dict[str, Any], version: str) -> None:
    """Raise on the first schema error of `obj` (a core kind or a LeaderWorkerSet) for Kubernetes `version`."""
    import kubernetes_validate

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

"""Rendered objects as YAML: one file per object plus a kustomization.yaml listing them (`kubectl apply -k DIR`),
or one multi-document stream (`kubectl apply -f -`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pdkv.errors import UsageError

KUSTOMIZATION = "kustomization.yaml"
HEADER = "# Rendered by `pdkv k8s render -f {source}`: change the deployment file and render again, not this file.\n"


def to_yaml(obj: Any) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # a dict shared by two containers is written twice, not as an &anchor a reader must follow

    # No line folding: the kv-transfer-config JSON stays one line, as vLLM reads it.
    return yaml.dump(obj, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=1 << 20)


def file_name(obj: dict[str, Any]) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def yaml_stream(objects: list[dict[str, Any]], source: str) -> str:
    return HEADER.format(source=source) + "".join(f"---\n{to_yaml(o)}" for o in objects)


def kustomization(files: list[str]) -> dict[str, Any]:
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": files}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _previous_files(out: Path) -> list[str]:
    """The resources an earlier rendering into `out` listed (only a kustomization.yaml pdkv wrote counts)."""
    import yaml

    path = out / KUSTOMIZATION
    try:
        text = path.read_text()
        listed = yaml.safe_load(text).get("resources", []) if text.startswith(HEADER.split("`")[0]) else []
    except (OSError, yaml.YAMLError, AttributeError):
        return []
    return [f for f in listed if isinstance(f, str) and "/" not in f and f.endswith(".yaml")]


def write_manifests(objects: list[dict[str, Any]], out: Path, source: str) -> list[Path]:
    """Write every object into `out` (created if missing) and a kustomization.yaml; return the paths written.

    Files an earlier rendering into `out` listed and this one does not (a table removed) are deleted, so the
    folder holds exactly what `kubectl apply -k` applies. UsageError before anything is written when `out` is
    not a folder that can be written.
    """
    if out.exists() and not out.is_dir():
        raise UsageError(f"-o {out}: not a folder", hint="name a folder for the manifests (created when missing)")
    names = [file_name(o) for o in objects]
    if len(set(names)) != len(names):
        raise UsageError("two rendered objects would share one file name", hint="give every table its own name")
    try:
        out.mkdir(parents=True, exist_ok=True)
        stale = [f for f in _previous_files(out) if f not in names]
        written = []
        for name, obj in zip(names, objects, strict=True):
            _write_atomic(out / name, HEADER.format(source=source) + to_yaml(obj))
            written.append(out / name)
        _write_atomic(out / KUSTOMIZATION, HEADER.format(source=source) + to_yaml(kustomization(names)))
        for f in stale:
            (out / f).unlink(missing_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot write the manifests into {out}: {exc.strerror or exc}", hint="pick a writable folder with -o") from None
    return [*written, out / KUSTOMIZATION]

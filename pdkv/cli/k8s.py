"""`pdkv k8s`: a deployment file as Kubernetes manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from pdkv.cli.options import JsonOpt
from pdkv.cli.output import console, print_json

k8s_app = typer.Typer(help="Kubernetes manifests from a deployment file.", no_args_is_help=True)

# rich markup would take [[prefill]] and [kubernetes] for tags: they are escaped.
RENDER_HELP = r"""Render the deployment file `pdkv up -f` reads as Kubernetes objects for a fleet.

The bootstrap server (the members registry: Deployment + Service), every
\[\[prefill]] and \[\[decode]] table (a Deployment, or a LeaderWorkerSet when its
TP spans nodes; `replicas` instances), the proxy (Deployment + Service, the
clients' entry point) and a ConfigMap with each engine's kv-transfer-config.
Kubernetes-only settings are the file's \[kubernetes] table (docs/k8s.md).
With an \[autoscale] table, one autoscaler per role on the planner's
pdkv_planner_desired_engines gauge: a HorizontalPodAutoscaler (kubernetes =
"hpa": the Prometheus adapter needs the rule --json gives as
prometheus_adapter, and docs/k8s.md) or a KEDA ScaledObject ("keda").

With -o DIR: one YAML file per object plus a kustomization.yaml
(`kubectl apply -k DIR`); without it, one YAML stream on stdout
(`kubectl apply -f -`). Bad input is one line, exit 2, nothing written.

Examples:

  pdkv k8s render -f examples/k8s-1p1d.toml -o k8s/

  pdkv k8s render -f examples/k8s-4p2d.toml --namespace serving | kubectl apply -f -

  pdkv k8s render -f deploy.toml --json

  pdkv k8s render -f examples/k8s-autoscale.toml -o k8s/
"""

FileOpt = Annotated[Path, typer.Option("--file", "-f", help="The deployment file (as for pdkv up -f).")]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Folder for the YAML files and kustomization.yaml.")]
NamespaceOpt = Annotated[
    str | None, typer.Option("--namespace", "-n", help="Namespace of every object. \\[default: the file's, else default]")
]


@k8s_app.command("render", help=RENDER_HELP)
def render_command(file: FileOpt, out: OutOpt = None, namespace: NamespaceOpt = None, json_out: JsonOpt = False) -> None:
    import sys

    from pdkv.deploy import load_deployment
    from pdkv.k8s import adapter_rules, file_name, render, write_manifests, yaml_stream

    dep = load_deployment(file)
    objects = render(dep, namespace=namespace, source=str(file))
    written = write_manifests(objects, out, file.name) if out is not None else []
    adapter = adapter_rules() if dep.autoscale is not None and dep.autoscale.kubernetes == "hpa" else None
    if json_out:
        print_json({"objects": objects, "files": [str(p) for p in written], "prometheus_adapter": adapter})
        return
    if out is None:
        sys.stdout.write(yaml_stream(objects, file.name))
        return
    table = Table(title=f"pdkv k8s render: {len(objects)} objects in {out}")
    for col in ("kind", "name", "file"):
        table.add_column(col)
    for obj in objects:
        table.add_row(obj["kind"], obj["metadata"]["name"], file_name(obj))
    console.print(table)
    console.print(f"apply with: kubectl apply -k {out}", soft_wrap=True, markup=False)
    if adapter is not None:
        console.print("the HorizontalPodAutoscalers read pdkv_planner_desired_engines through the Prometheus adapter: "
                      "add its rule (docs/k8s.md, or --json's prometheus_adapter) to the adapter's config", soft_wrap=True, markup=False)


def register(app: typer.Typer) -> None:
    app.add_typer(k8s_app, name="k8s")

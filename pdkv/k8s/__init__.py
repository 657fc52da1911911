"""A deployment file as Kubernetes objects (`pdkv k8s render`).

- `settings`: the checks of the file's `[kubernetes]` table (`KubernetesEntry`, pdkv.deploy.plan.schema);
- `pods`: the parts of a pod every engine needs for P/D (resources, env, ports, probes, doctor);
- `render`: `render(dep)`, the objects as plain dicts, pure;
- `autoscale`: with an `[autoscale]` table, a HorizontalPodAutoscaler or KEDA ScaledObject per role on the
  planner's gauge, and the Prometheus adapter's rule that serves it (`adapter_rules`);
- `write`: YAML files plus a kustomization.yaml.

The engines' argv and kv-transfer-config come from `pdkv.deploy.plan.engine` and
`pdkv.deploy.plan.topology.engine_spec`, the code `pdkv up` runs them with.
This package sits above pdkv.deploy and imports neither typer nor rich.
"""

from pdkv.k8s.autoscale import adapter_rules
from pdkv.k8s.render import render
from pdkv.k8s.settings import check_kubernetes
from pdkv.k8s.write import file_name, write_manifests, yaml_stream

__all__ = ["adapter_rules", "check_kubernetes", "file_name", "render", "write_manifests", "yaml_stream"]

"""A deployment file as Kubernetes objects (`pdkv k8s render`).

- `settings`: the file's `[kubernetes]` table (`KubernetesEntry`) and its checks;
- `pods`: the parts of a pod every engine needs for P/D (resources, env, ports, probes, doctor);
- `render`: `render(dep)`, the objects as plain dicts, pure;
- `write`: YAML files plus a kustomization.yaml.

The engines' argv and kv-transfer-config come from `pdkv.launch` and
`pdkv.deploy.topology.engine_spec`, the code `pdkv up` runs them with.
This package imports neither typer nor rich; `settings` imports nothing of
pdkv's beyond its errors, so the deployment file's schema can name it.
"""

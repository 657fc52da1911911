"""A P/D deployment on one host: topology, pre-flight, supervision, status.

- `topology`: `Deployment` (deploy.toml or the built-in local 1P1D) and
  `deployment_parts`, the exact launch plan of every part in start order;
- `preflight`: every reason it would fail to start, found before anything starts;
- `process`: `ManagedProcess`, one supervised child (process group, log, health, bounded stop);
- `restart`: `RestartPolicy`, when a part that died starts again (pure);
- `supervisor`: start the parts in order, each healthy before the next, restart what dies, stop in reverse;
- `status`: health, bootstrap registrations and proxy figures of a running one.
"""

from pdkv.deploy.preflight import Problem, preflight, raise_problems, shared_cores
from pdkv.deploy.process import ManagedProcess
from pdkv.deploy.restart import RestartDecision, RestartPolicy, Verdict
from pdkv.deploy.status import StatusReport, collect_status, status_targets
from pdkv.deploy.supervisor import PartEvent, Supervisor
from pdkv.deploy.topology import (
    Deployment,
    Part,
    deployment_parts,
    ensure_tiny_model,
    external_bootstraps,
    gpu_count,
    load_deployment,
    local_deployment,
    tiny_model_path,
)

__all__ = [
    "Deployment",
    "ManagedProcess",
    "Part",
    "PartEvent",
    "Problem",
    "RestartDecision",
    "RestartPolicy",
    "StatusReport",
    "Supervisor",
    "Verdict",
    "collect_status",
    "deployment_parts",
    "ensure_tiny_model",
    "external_bootstraps",
    "gpu_count",
    "load_deployment",
    "local_deployment",
    "preflight",
    "raise_problems",
    "shared_cores",
    "status_targets",
    "tiny_model_path",
]

"""A P/D deployment: its file, its parts, and running it on this host (`pdkv up`), pre-flight and status.

- `schema`: the deployment file's tables as frozen Structs (`Deployment`, `KubernetesEntry` among them);
- `loader`: `load_deployment`, a file read and validated;
- `fleet`: the `[[hosts]]` of a file across several hosts, and which of them this `pdkv up` starts;
- `engine`: `EngineSpec` -> `Launch`, one vLLM engine's exact command and environment;
- `args`: pieces of the parts' command lines that `pdkv up` and `pdkv k8s render` share;
- `topology`: `deployment_parts` (every part's launch, in start order) and the local 1P1D;
- `machine`: what this machine has (GPUs, RDMA devices, addresses);
- `single`: one engine by role (`pdkv up --role`), the local 1P1D's core split;
- `preflight`: every reason it would fail to start, found before anything starts;
- `process`: `ManagedProcess`, one supervised child (process group, log, health, bounded stop);
- `restart`: `RestartPolicy`, when a part that died starts again (pure);
- `supervisor`: start the parts in order, each healthy before the next, restart what dies, stop in reverse;
- `run`: `pdkv up` as a library: `resolve` the parts to start, `PartsRun` to start, watch and stop them;
- `lifeline`, `watchdog`: the parts never outlive `pdkv up`: a watchdog process stops them if it dies;
- `leftovers`: the record of what a `pdkv up` started, what of it still runs, and `pdkv down`;
- `warmup`, `vllm_logging`, `exposure`: the first request, the engines' logs, parts reachable without a key;
- `status`: health, bootstrap registrations and proxy figures of a running one.
"""

from pdkv.deploy.args import bootstrap_args, proxy_args
from pdkv.deploy.autoscale import ScaleEvent
from pdkv.deploy.engine import EngineSpec, Launch, engine_argv, engine_launch, http_url
from pdkv.deploy.leftovers import UpRecord, running, stop_recorded
from pdkv.deploy.lifeline import Lifeline
from pdkv.deploy.loader import deployment_from_dict, load_deployment
from pdkv.deploy.machine import gpu_count, local_addresses, rdma_devices
from pdkv.deploy.preflight import Problem, pd_disagreements, preflight, raise_problems, shared_cores
from pdkv.deploy.process import ManagedProcess
from pdkv.deploy.restart import RestartDecision, RestartPolicy, Verdict
from pdkv.deploy.run import PartsRun, Startup, UpOptions, hand_out_key, prepare, resolve
from pdkv.deploy.schema import (
    AutoscaleEntry,
    AutoscalerKind,
    Deployment,
    EngineEntry,
    HostEntry,
    KubernetesEntry,
    RoleBounds,
)
from pdkv.deploy.status import StatusReport, collect_status, part_hosts, status_targets
from pdkv.deploy.supervisor import PartEvent, Supervisor
from pdkv.deploy.topology import Part, deployment_parts, engine_spec, external_bootstraps, local_deployment

__all__ = [
    "AutoscaleEntry",
    "AutoscalerKind",
    "Deployment",
    "EngineEntry",
    "EngineSpec",
    "HostEntry",
    "KubernetesEntry",
    "Launch",
    "Lifeline",
    "ManagedProcess",
    "Part",
    "PartEvent",
    "PartsRun",
    "Problem",
    "RestartDecision",
    "RestartPolicy",
    "RoleBounds",
    "ScaleEvent",
    "Startup",
    "StatusReport",
    "Supervisor",
    "UpOptions",
    "UpRecord",
    "Verdict",
    "bootstrap_args",
    "collect_status",
    "deployment_from_dict",
    "deployment_parts",
    "engine_argv",
    "engine_launch",
    "engine_spec",
    "external_bootstraps",
    "gpu_count",
    "hand_out_key",
    "http_url",
    "load_deployment",
    "local_addresses",
    "local_deployment",
    "part_hosts",
    "pd_disagreements",
    "preflight",
    "prepare",
    "proxy_args",
    "raise_problems",
    "rdma_devices",
    "resolve",
    "running",
    "shared_cores",
    "status_targets",
    "stop_recorded",
]

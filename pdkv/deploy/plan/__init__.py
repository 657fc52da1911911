"""The plan: from a deployment file or `pdkv up`'s flags to the parts to launch, each with its exact command,
environment and ports. Pure, but for reading the file and what this machine has; no process starts here, and
nothing here imports pdkv.deploy.run (which starts what the plan says).

- `schema`: the deployment file's tables as frozen Structs (`Deployment`, `KubernetesEntry` among them);
- `loader`: `load_deployment`, a file read and validated;
- `fleet`: the `[[hosts]]` of a file across several hosts, and which of them this `pdkv up` starts;
- `machine`: what this machine has (GPUs, RDMA devices, NUMA nodes, addresses);
- `launch`: `Launch`, what starts a part (command, environment, cores) and the URL it is reached at;
- `engine`: `EngineSpec` -> `Launch`, one vLLM engine's exact command and environment;
- `cores`: the one home of the CPU cores each engine is bound to (read, split over ranks, allocated);
- `ports`: the one allocator of every port a file's parts (and the engines `[autoscale]` may add) bind;
- `topology`: `deployment_parts` (every part's launch, in start order), the local 1P1D, one engine by role
  (`pdkv up --role`), and the bootstrap's and proxy's command lines (`pdkv k8s render` shares them);
- `added_engines`: `[autoscale]` checked for `pdkv up -f`, and the table and parts of each engine it may add;
- `exposure`: the parts reachable beyond loopback without a deployment key;
- `vllm_logging`: the engines' logging configuration;
- `startup`: `resolve`, `pdkv up`'s options to the `Startup` this host starts.
"""

from pdkv.deploy.plan.added_engines import added_entry, added_slot_parts
from pdkv.deploy.plan.cores import parse_cores
from pdkv.deploy.plan.engine import EngineSpec, engine_argv, engine_launch
from pdkv.deploy.plan.exposure import exposure_warnings
from pdkv.deploy.plan.launch import Launch, http_url
from pdkv.deploy.plan.loader import deployment_from_dict, load_deployment
from pdkv.deploy.plan.machine import gpu_count, local_addresses, numa_nodes, rdma_devices
from pdkv.deploy.plan.ports import PortUse, Role, allocate_ports, distinct_per_host
from pdkv.deploy.plan.schema import (
    AutoscaleEntry,
    AutoscalerKind,
    Deployment,
    EngineEntry,
    HostEntry,
    KubernetesEntry,
    RestartMode,
    RoleBounds,
)
from pdkv.deploy.plan.startup import Startup, UpOptions, resolve
from pdkv.deploy.plan.topology import (
    CPU_BLOCK_MULTIPLE,
    Part,
    bootstrap_args,
    deployment_parts,
    engine_spec,
    external_bootstraps,
    local_deployment,
    proxy_args,
)
from pdkv.deploy.plan.vllm_logging import with_vllm_logging, write_logging_config

__all__ = [
    "CPU_BLOCK_MULTIPLE",
    "AutoscaleEntry",
    "AutoscalerKind",
    "Deployment",
    "EngineEntry",
    "EngineSpec",
    "HostEntry",
    "KubernetesEntry",
    "Launch",
    "Part",
    "PortUse",
    "RestartMode",
    "Role",
    "RoleBounds",
    "Startup",
    "UpOptions",
    "added_entry",
    "added_slot_parts",
    "allocate_ports",
    "bootstrap_args",
    "deployment_from_dict",
    "deployment_parts",
    "distinct_per_host",
    "engine_argv",
    "engine_launch",
    "engine_spec",
    "exposure_warnings",
    "external_bootstraps",
    "gpu_count",
    "http_url",
    "load_deployment",
    "local_addresses",
    "local_deployment",
    "numa_nodes",
    "parse_cores",
    "proxy_args",
    "rdma_devices",
    "resolve",
    "with_vllm_logging",
    "write_logging_config",
]

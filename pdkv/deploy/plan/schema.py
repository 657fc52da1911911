"""The deployment file's schema: one frozen Struct per table (pure; the loader is pdkv.deploy.plan.loader).

The same file drives `pdkv up -f` (pdkv.deploy.plan.topology derives its parts),
each host of a fleet (`[[hosts]]`, pdkv.deploy.plan.fleet) and `pdkv k8s render`
(the `[kubernetes]` table, checked by pdkv.k8s.settings).

    model = "/models/Qwen3-8B"   # every engine's default
    connector = "pdkv"           # or "mooncake"
    transport = "rdma"           # or "tcp", "socket" (pdkv's own TCP), "cma", "ipc" (one host)
    [bootstrap]                  # mode = "standalone" | "in-worker" | "external"
    port = 8998
    [[prefill]]
    gpu = "0"
    port = 8100
    [[decode]]
    gpu = "2"
    port = 8200
    [proxy]
    port = 8000

`restart = "on-failure" | "no"` at the top sets every part's restart policy;
a [[prefill]], [[decode]], [bootstrap] or [proxy] table may set its own.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pdkv.bootstrap import DEFAULT_PORT as DEFAULT_BOOTSTRAP_PORT
from pdkv.connector import DEFAULT_LAYER_GROUPS
from pdkv.deploy.plan.engine import Connector, Platform
from pdkv.transport import TransportName

RestartMode = Literal["on-failure", "no"]  # what happens to a part that dies (pdkv.deploy.run.restart)
BootstrapMode = Literal["standalone", "in-worker", "external"]
AntiAffinity = Literal["none", "preferred", "required"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
MIN_CPU_KV_CACHE_BYTES = 1 << 20  # cpu_kv_cache_bytes: a floor that catches a size meant in MiB or GiB written as bytes


class HostEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One [[hosts]] table: a name the parts use, and the address peers reach it at."""

    name: str
    address: str


class KubernetesEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One `[kubernetes]` table; every key has a default, so the table itself may be left out."""

    name: str = "pdkv"
    namespace: str = "default"
    image: str = "pdkv-vllm:latest"  # vLLM (with CUDA) and pdkv in one image: docs/k8s.md builds it
    service_image: str | None = None  # bootstrap and proxy (pdkv alone suffices); default: image
    image_pull_policy: PullPolicy = "IfNotPresent"
    gpus_per_node: int = 8
    gpu_resource: str = "nvidia.com/gpu"
    rdma_resource: str = "rdma/ib"  # the RDMA device plugin's name: rdma/ib, rdma/rdma_shared_device_a, ...
    rdma_per_pod: int = 1
    shm_size: str = "16Gi"  # /dev/shm (a memory emptyDir): NCCL and vLLM's shared-memory broadcast
    anti_affinity: AntiAffinity = "none"
    doctor: bool = True  # `pdkv doctor` as an init container of every engine pod
    grace_period_s: int = 120  # SIGTERM to SIGKILL: the requests in flight finish
    mooncake_port: int = 17000  # first port of Mooncake's range (MC_MIN_RPC_PORT); 4 per GPU of a pod
    side_channel_port: int = 5600  # prefill pods: pdkv's side channel, TP rank r on side_channel_port + r
    socket_port: int = 5700  # decode pods, transport socket: the KV listener, TP rank r on socket_port + r
    master_port: int = 29501  # torch.distributed between the nodes of one instance (TP across nodes)
    proxy_replicas: int = 1
    proxy_service_type: ServiceType = "ClusterIP"
    token_secret: str | None = None  # a Secret holding the bootstrap token (created by the operator)
    token_key: str = "token"
    model_pvc: str | None = None  # a PersistentVolumeClaim holding the weights, mounted read-only at model_mount
    model_mount: str = "/models"
    node_selector: dict[str, str] = {}
    service_account: str | None = None
    monitors: bool = False  # a PodMonitor and a ServiceMonitor for the Prometheus Operator (pdkv.k8s.monitors)


class EngineEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One [[prefill]] or [[decode]] table; unset fields fall back to the deployment's."""

    port: int
    gpu: str | None = None
    omp_bind: str | None = None
    model: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    tp: int = 1
    max_model_len: int | None = None
    bootstrap_url: str | None = None
    extra_args: list[str] = []
    env: dict[str, str] = {}
    restart: RestartMode | None = None
    host: str | None = None  # a [[hosts]] name
    replicas: int = 1  # instances of this engine in Kubernetes (`pdkv k8s render`); `pdkv up` starts one
    kv_events_port: int | None = None  # its KV events publisher (replay on the next port); default: from kv_events_port
    # A decode engine, transport socket: its KV listener's port, TP rank r on socket_port + r (firewalls); default: a free one.
    socket_port: int | None = None


class BootstrapEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mode: BootstrapMode = "standalone"
    port: int = DEFAULT_BOOTSTRAP_PORT
    url: str | None = None
    restart: RestartMode | None = None
    host: str | None = None  # a [[hosts]] name (standalone mode)


class ProxyEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    port: int = 8000
    policy: Literal["round-robin", "least-outstanding", "kv-aware"] | None = None
    local_prefill_tokens: int | None = None  # kv-aware: D computes the prompt alone when it lacks at most this many tokens
    extra_args: list[str] = []
    restart: RestartMode | None = None
    host: str | None = None  # a [[hosts]] name


AutoscalerKind = Literal["hpa", "keda"]


class RoleBounds(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[autoscale.prefill]` or `[autoscale.decode]`: how few and how many engines of the role may serve.

    An engine `pdkv up` adds takes the role's first table's settings, a port of its own and, in order, the next
    of `omp_bind` (CPU cores) or `gpu` (CUDA_VISIBLE_DEVICES): this host's hardware, which no table can say for
    an engine it does not list (Kubernetes' scheduler places its pods; `pdkv k8s render` ignores both)."""

    min: int = 1
    max: int = 1
    omp_bind: list[str] = []  # CPU: cores of each added engine (default: the cores the fewest engines are bound to)
    gpu: list[str] = []  # GPU: each added engine's GPUs (needed on a GPU host when max exceeds the engines listed)


class AutoscaleEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[autoscale]` table: the planner's targets and each role's bounds (docs/planner.md).

    `pdkv up -f` starts and stops local engines within the bounds as the proxy's planner signal asks; `pdkv k8s
    render` emits an autoscaler per role on the same signal (`kubernetes`: a HorizontalPodAutoscaler through the
    Prometheus adapter, or a KEDA ScaledObject reading `prometheus_url`).

        [autoscale]
        profile = "qwen3-8b.profile.json"   # from `pdkv profile`
        ttft_ms = 2000
        itl_ms = 50
        [autoscale.prefill]
        min = 1
        max = 4
    """

    profile: str
    ttft_ms: float
    itl_ms: float
    quantile: float = 0.9
    interval_s: float = 5.0  # how often the proxy recomputes the desired counts
    up_after_s: float = 0.0  # a larger need lasts this long before it is asked for
    down_after_s: float = 60.0  # a smaller count suffices this long before engines are let go
    down_margin: float = 0.8  # ... predicting latencies under this share of the targets
    drain_timeout_s: float = 120.0  # a stopped engine's requests in flight get this long to finish
    prefill: RoleBounds = RoleBounds()
    decode: RoleBounds = RoleBounds()
    kubernetes: AutoscalerKind = "hpa"
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"  # KEDA's trigger reads it


class Deployment(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything `pdkv up -f deploy.toml` starts on this host."""

    model: str
    served_model_name: str | None = None
    connector: Connector = "pdkv"
    transport: TransportName = "rdma"  # how the KV moves (pdkv.transport.TransportName)
    device: str = ""
    platform: Platform = "gpu"
    host: str = "0.0.0.0"
    host_ip: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    # Platform cpu: each engine's KV cache in bytes (vLLM's --kv-cache-memory-bytes), at least MIN_CPU_KV_CACHE_BYTES;
    # unset: 1 GiB (VLLM_CPU_KVCACHE_SPACE=1). vLLM fills all of it before an engine is ready.
    cpu_kv_cache_bytes: int | None = None
    startup_timeout: float = 900.0
    restart: RestartMode = "on-failure"
    bootstrap: BootstrapEntry = BootstrapEntry()
    prefill: list[EngineEntry] = []
    decode: list[EngineEntry] = []
    proxy: ProxyEntry | None = ProxyEntry()
    extra_args: list[str] = []
    env: dict[str, str] = {}
    hosts: list[HostEntry] = []  # a fleet: each part names one (pdkv.deploy.plan.fleet)
    kubernetes: KubernetesEntry = KubernetesEntry()  # read by `pdkv k8s render` only (pdkv.k8s)
    # The deployment key (docs/security.md): `pdkv up` hands it to every part as PDKV_TOKEN. Unset: PDKV_TOKEN
    # from the environment of `pdkv up`, if any. Better kept out of the file (env, or a Kubernetes Secret).
    token: str | None = None
    # KV cache events on every engine (the proxy's kv-aware policy follows them): engine k (prefills, then
    # decodes) publishes on kv_events_port + 2k and replays on the next port, unless its table says otherwise or
    # another part has that port; pdkv's side channels take the ports after them (pdkv.deploy.plan.ports).
    kv_events: bool = True
    kv_events_port: int = 5557
    autoscale: AutoscaleEntry | None = None  # the planner starts and stops engines within bounds (pdkv.planner)
    # Transport socket: each P's TCP connections to each D (docs/socket.md); 0: the worker's cores, at most 4.
    socket_connections: int = 0
    # Transport socket: each connection's socket buffers, on P and D (docs/socket.md); unset: the transport's 96 KiB.
    socket_buffer_bytes: int | None = None
    # Transport socket: each P writes a prompt's KV a group of layers at a time as its forward computes them
    # (docs/socket.md); false: one write once that forward is done; unset: the connector's choice (on where the KV
    # cache is on a GPU, off on a CPU host). True is refused with any other transport.
    socket_write_layers: bool | None = None
    # Transport socket, writing layer by layer: the writes a forward's layers are cut into (docs/socket.md).
    socket_layer_groups: int = DEFAULT_LAYER_GROUPS
    # Transport socket: each P's writes of GPU memory run in a send process of its own (docs/socket.md); false: P's
    # own threads write; unset: the connector's choice (on where the KV cache is on a GPU). True is refused with
    # any other transport.
    socket_send_process: bool | None = None

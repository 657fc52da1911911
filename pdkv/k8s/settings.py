"""Checks of the deployment file's `[kubernetes]` table (`KubernetesEntry`, in pdkv.deploy.plan.schema with the
file's other tables): what only `pdkv k8s render` reads.

    [kubernetes]
    name = "qwen3"                      # prefix of every object's name, app.kubernetes.io/instance
    namespace = "serving"               # --namespace overrides it
    image = "registry.example/pdkv-vllm:0.1.0"
    gpus_per_node = 4                   # TP above it spans nodes: a LeaderWorkerSet
    rdma_resource = "rdma/rdma_shared_device_a"
    anti_affinity = "preferred"         # keep P and D pods off one node
    token_secret = "pdkv-token"         # the bootstrap token, from this Secret's key `token`

`pdkv up -f` accepts the table and ignores it; unknown keys are refused by
both. Checking a value (names Kubernetes would refuse) is `check_kubernetes`:
pure, one ConfigError line naming the key.
"""

from __future__ import annotations

import re

from pdkv.deploy import KubernetesEntry
from pdkv.errors import ConfigError

# Kubernetes' own forms (apimachinery's validation): a DNS-1123 label, a DNS-1123 subdomain, a qualified name.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
# The longest suffix pdkv adds to `name` ("-decode-12"), and LWS's pod names on top ("-<group>-<index>").
MAX_NAME = 40


MOONCAKE_PORTS_PER_GPU = 4  # Mooncake takes two per TransferEngine (RPC, tcp data) at random in its range: room to retry


def check_resource_name(value: str, key: str, *, source: str) -> None:
    """An extended resource name as Kubernetes accepts it: `prefix/name` (e.g. nvidia.com/gpu, rdma/ib)."""
    prefix, slash, name = value.partition("/")
    ok = bool(slash) and len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.match(prefix)) and len(name) <= 63 and bool(
        _QUALIFIED_NAME.match(name)
    )
    if not ok:
        raise ConfigError(
            f"{source}: [kubernetes] {key} = {value!r} is not a Kubernetes resource name",
            hint="write DOMAIN/NAME as the device plugin advertises it, e.g. nvidia.com/gpu or rdma/rdma_shared_device_a",
        )


def check_dns_label(value: str, key: str, *, source: str, max_len: int = 63) -> None:
    if len(value) > max_len or not _DNS_LABEL.match(value):
        raise ConfigError(
            f"{source}: {key} = {value!r} is not a Kubernetes name (lower-case letters, digits and '-', at most {max_len})",
            hint="e.g. qwen3-8b",
        )


def check_kubernetes(k: KubernetesEntry, *, source: str) -> None:
    """Raise ConfigError (one line) for a `[kubernetes]` value Kubernetes would refuse."""
    check_dns_label(k.name, "[kubernetes] name", source=source, max_len=MAX_NAME)
    check_dns_label(k.namespace, "[kubernetes] namespace", source=source)
    check_resource_name(k.gpu_resource, "gpu_resource", source=source)
    check_resource_name(k.rdma_resource, "rdma_resource", source=source)
    if k.token_secret is not None:
        check_dns_label(k.token_secret, "[kubernetes] token_secret", source=source, max_len=253)
    if k.model_pvc is not None:
        check_dns_label(k.model_pvc, "[kubernetes] model_pvc", source=source, max_len=253)
    if not k.model_mount.startswith("/") or k.model_mount.rstrip("/") in ("", "/dev", "/dev/shm"):
        raise ConfigError(f"{source}: [kubernetes] model_mount = {k.model_mount!r} is not a folder a volume can go on",
                          hint='an absolute path such as "/models"')
    if k.service_account is not None:
        check_dns_label(k.service_account, "[kubernetes] service_account", source=source, max_len=253)
    if not _QUANTITY.match(k.shm_size):
        raise ConfigError(f"{source}: [kubernetes] shm_size = {k.shm_size!r} is not a Kubernetes quantity", hint='e.g. "16Gi"')
    for key, value, low in (("gpus_per_node", k.gpus_per_node, 1), ("rdma_per_pod", k.rdma_per_pod, 1),
                            ("proxy_replicas", k.proxy_replicas, 0), ("grace_period_s", k.grace_period_s, 0)):
        if value < low:
            raise ConfigError(f"{source}: [kubernetes] {key} must be at least {low}, got {value}")
    for key, port in (("mooncake_port", k.mooncake_port), ("master_port", k.master_port), ("side_channel_port", k.side_channel_port),
                      ("socket_port", k.socket_port)):
        if not 0 < port < 65536 - 64:
            raise ConfigError(f"{source}: [kubernetes] {key} {port} is out of range", hint="pick a port below 65000")
    if not k.image.strip() or (k.service_image is not None and not k.service_image.strip()):
        raise ConfigError(f"{source}: [kubernetes] image is empty", hint="name the image with vLLM and pdkv, see docs/k8s.md")

"""The connector's settings (`kv_connector_extra_config`) and its reading of kv_transfer_params.

Pure: no vLLM import. Keys that vLLM's MooncakeConnector also reads keep its
names (`mooncake_protocol`, `device_name`, `bootstrap_server_address`), so a
deployment switches connectors by name alone. pdkv calls what `mooncake_protocol`
selects the transport (it also selects ipc and cma, which are not Mooncake) and
accepts `transport` as its own name for the same key.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from pdkv.bootstrap import DEFAULT_PORT, PORT_ENV
from pdkv.errors import ConfigError, ParamsError
from pdkv.wire import DecodeParams, PrefillParams
from pdkv.transport import MAX_SOCKET_CONNECTIONS, TRANSPORTS, TransportName, socket_buffer_problem

# kv_connector_extra_config keys that name the transport: vLLM's, then pdkv's own.
TRANSPORT_KEYS = ("mooncake_protocol", "transport")
DEFAULT_LAYER_GROUPS = 6  # socket_layer_groups: the writes a forward's layers are cut into
MAX_LAYER_GROUPS = 1024


def layer_groups_problem(groups: int) -> str | None:
    """What is wrong with `groups` as socket_layer_groups (the connector's and the deployment file's one rule)."""
    return None if 1 <= groups <= MAX_LAYER_GROUPS else f"must be 1..{MAX_LAYER_GROUPS}, got {groups}"


class ConnectorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """kv_connector_extra_config, typed. Unknown keys are ignored (vLLM's own keys may be present)."""

    # tcp/rdma over Mooncake; ipc: CUDA IPC between GPUs of one host; cma: process_vm_writev between
    # processes of one host, KV in host memory; socket: pdkv's own TCP connections, any hosts, host or GPU memory
    # (ipc, cma and socket are pdkv's own; vLLM's connector has none of them).
    # Read from `mooncake_protocol` (vLLM's key) or `transport` (load_config).
    transport: TransportName = "tcp"
    # ipc on vLLM 0.34+: how D shares its KV memory with P. "fd": the extensible KV cache, each segment one CUDA
    # VMM allocation exported as a file descriptor (EXPORTS_FD); "legacy": CUDA IPC handles, which turns the
    # extensible KV cache off (LEGACY_IPC), for engines that cannot have it (--kv-cache-memory-bytes,
    # --num-gpu-blocks-override, a GPU without VMM). Older vLLMs allocate with cudaMalloc: handles either way.
    ipc_handles: Literal["fd", "legacy"] = "fd"
    device_name: str = ""
    # "host:port" of a standalone bootstrap server; unset: P's TP0 worker runs one.
    bootstrap_server_address: str | None = None
    # P: how long a pull waits for a transfer_id P's scheduler has not registered.
    unknown_wait_s: float = 120.0
    # P: how long finished blocks wait for D's pull before they are freed.
    expiry_s: float = 120.0
    # D: how long P may stay silent (no heartbeat, no answer) before the pull fails.
    liveness_s: float = 10.0
    # P: interval of PENDING heartbeats to waiting pulls.
    heartbeat_s: float = 1.0
    # P: bound on one KV write; a peer that stops answering fails the transfer after it.
    write_timeout_s: float = 30.0
    # P: every worker registers its side channel again this often, so a restarted bootstrap server (which
    # starts empty) lists P again within this bound, without restarting P. 0: register once.
    register_interval_s: float = 5.0
    # Both: the bootstrap server whose members registry this engine joins, so a proxy following it
    # (`pdkv proxy --members URL`) routes to it; env PDKV_MEMBERS_URL. Unset: P joins its standalone
    # bootstrap_server_address, D joins nothing.
    members_url: str | None = None
    # Both: the engine's own OpenAI URL (http://ADDR:PORT) its member record names; env PDKV_ADVERTISE_URL.
    # Without one the engine joins no registry.
    advertise_url: str | None = None
    # Both: append one JSON line per finished transfer under this directory.
    trace_dir: str | None = None
    # P: the side channel's port: TP rank r of DP rank d binds side_channel_port + d * tp_size + r (a pod declares them;
    # `pdkv up` gives each prefill its own, pdkv.deploy.plan.ports); 0: a free port.
    side_channel_port: int = 0
    # D, transport socket: the port its listener binds, TP rank r on socket_port + r (a pod declares them); 0: a free port.
    socket_port: int = 0
    # P, transport socket: TCP connections to each D, every transfer split over them (docs/socket.md); 0: as many
    # as the worker's cores, at most 4.
    socket_connections: int = 0
    # Both, transport socket: each connection's socket buffers in bytes (SO_SNDBUF on P, SO_RCVBUF on D; the kernel
    # doubles them). Unset: the transport's 96 KiB, for P and D sharing a host's cores (docs/socket.md); a long or
    # fast path wants more; 0: the kernel's autotuning.
    socket_buffer_bytes: int | None = None
    # P, transport socket: write a one-token prompt's blocks during the forward that computes them, a group of layers
    # at a time as vLLM saves them (save_kv_layer), rather than all of them once that forward is done
    # (docs/socket.md). Unset: on where the KV cache is on a GPU (faster there, docs/bench.md), off on a CPU host
    # (the writes would take P's cores from its forward); `writes_layers`. True is refused with any other transport.
    socket_write_layers: bool | None = None
    # P, transport socket, KV cache on a GPU: its writes run in a child process that opens P's KV through CUDA IPC
    # and stages it by the GPU's copy engines, so that they take neither the interpreter's lock from P's model
    # runner nor the GPU's SMs from its forward (docs/socket.md). Unset: on where the KV cache is on a GPU; false:
    # P's own threads write. A child that cannot start or dies leaves P writing itself (logged).
    socket_send_process: bool | None = None
    # P, writing layer by layer: the writes a forward's layers are cut into, runs of neighbouring layers each
    # written once all of its layers are computed (docs/socket.md); more than the model's layers: one a layer.
    socket_layer_groups: int = DEFAULT_LAYER_GROUPS
    # P: the host the side channel binds to and advertises (default: VLLM_HOST_IP or 127.0.0.1).
    side_channel_host: str | None = None
    # Both: Python's GIL switch interval in the worker process, in microseconds. The side channel and
    # the writes run on threads that must take the GIL from a model runner busy in Python; Python's
    # default (5000) can hold a finished transfer back by up to 5 ms. 0 leaves the interpreter's own.
    switch_interval_us: int = 200
    # P, KV cache in host memory (CPU hosts): after the forward that completes a one-token prompt, the
    # model runner waits up to this long for the KV write that starts then, so the write has the core to
    # itself instead of a time slice beside P's sampling. Ignored with the KV cache on a GPU. 0: no wait.
    wait_write_ms: float = 20.0
    # D: in a step with nothing to compute, the worker waits up to this long for a pull in flight to
    # conclude, so that its news reaches the scheduler in this step rather than the next (vLLM's engine
    # sleeps 1 ms between idle steps). A new request reaching an idle D waits at most this long more. 0: off.
    idle_wait_ms: float = 2.0
    # P, KV cache in host memory (CPU hosts): in a step with nothing to compute while it holds blocks for D's
    # pulls, the worker waits up to this long for one of those sends to conclude. vLLM steps such an engine
    # without pause (each step a round trip to every rank), which keeps P's cores busy and starves a D sharing
    # them; the wait gives them back. The send itself never waits for it (it starts when D's pull arrives); a
    # new request reaching P in such a step is scheduled at most this much later. Ignored with the KV cache on
    # a GPU. 0: off.
    hold_wait_ms: float = 20.0

    def writes_layers(self, on_gpu: bool) -> bool:
        """Whether P writes layer by layer (socket_write_layers): as set, or unset, over the socket transport with the
        KV cache on a GPU (`on_gpu`)."""
        if self.socket_write_layers is not None:
            return self.socket_write_layers
        return self.transport == "socket" and on_gpu

    def sends_from_process(self, on_gpu: bool) -> bool:
        """Whether P's socket writes run in a send process (socket_send_process): as set, or unset, with the KV
        cache on a GPU (`on_gpu`); never without the socket transport or GPU memory."""
        return self.transport == "socket" and on_gpu and self.socket_send_process is not False

    def __post_init__(self) -> None:
        for name in ("unknown_wait_s", "expiry_s", "liveness_s", "heartbeat_s", "write_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kv_connector_extra_config.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.side_channel_port <= 65535 - 1024:
            raise ConfigError(f"kv_connector_extra_config.side_channel_port must be 0..64511, got {self.side_channel_port}")
        if not 0 <= self.socket_port <= 65535 - 1024:
            raise ConfigError(f"kv_connector_extra_config.socket_port must be 0..64511, got {self.socket_port}")
        if not 0 <= self.socket_connections <= MAX_SOCKET_CONNECTIONS:
            raise ConfigError(
                f"kv_connector_extra_config.socket_connections must be 0..{MAX_SOCKET_CONNECTIONS}, got {self.socket_connections}")
        if self.socket_buffer_bytes is not None and (problem := socket_buffer_problem(self.socket_buffer_bytes)):
            raise ConfigError(f"kv_connector_extra_config.socket_buffer_bytes {problem}")
        if problem := layer_groups_problem(self.socket_layer_groups):
            raise ConfigError(f"kv_connector_extra_config.socket_layer_groups {problem}")
        if self.socket_send_process and self.transport != "socket":
            raise ConfigError(f"kv_connector_extra_config.socket_send_process needs the socket transport, not {self.transport}",
                              hint="set mooncake_protocol to socket or leave socket_send_process out")
        if self.socket_write_layers and self.transport != "socket":
            raise ConfigError(
                f"kv_connector_extra_config.socket_write_layers needs the socket transport, not {self.transport}",
                hint="over Mooncake tcp a layer-by-layer write slowed P's forward (docs/bench.md); set mooncake_protocol to socket "
                     "or leave socket_write_layers out",
            )
        if self.register_interval_s < 0:
            raise ConfigError(f"kv_connector_extra_config.register_interval_s must be 0 or more, got {self.register_interval_s}")
        if not 0 <= self.idle_wait_ms <= 1_000:
            raise ConfigError(f"kv_connector_extra_config.idle_wait_ms must be 0..1000, got {self.idle_wait_ms}")
        if not 0 <= self.hold_wait_ms <= 1_000:
            raise ConfigError(f"kv_connector_extra_config.hold_wait_ms must be 0..1000, got {self.hold_wait_ms}")
        if not 0 <= self.wait_write_ms <= 10_000:
            raise ConfigError(f"kv_connector_extra_config.wait_write_ms must be 0..10000, got {self.wait_write_ms}")
        if not 0 <= self.switch_interval_us <= 1_000_000:
            raise ConfigError(f"kv_connector_extra_config.switch_interval_us must be 0..1000000, got {self.switch_interval_us}")
        if self.heartbeat_s >= self.liveness_s:
            raise ConfigError(
                f"heartbeat_s ({self.heartbeat_s}) must be shorter than liveness_s ({self.liveness_s})",
                hint="D fails a pull when P is silent for liveness_s; heartbeats must come more often",
            )


def load_config(extra: dict[str, Any] | None) -> ConnectorConfig:
    """Validate kv_connector_extra_config; raise ConfigError naming the bad key.

    The transport comes from `mooncake_protocol` or `transport`; both set to different values is an error.
    """
    fields = dict(extra or {})
    given = {key: fields.pop(key) for key in TRANSPORT_KEYS if key in fields}
    if len(set(map(str, given.values()))) > 1:
        raise ConfigError(
            f"kv_connector_extra_config sets mooncake_protocol={given['mooncake_protocol']!r} and transport={given['transport']!r}",
            hint="set one of them (they name the same thing)",
        )
    for key, value in given.items():
        if value not in TRANSPORTS:
            raise ConfigError(f"invalid kv_connector_extra_config: {key} must be one of {', '.join(TRANSPORTS)}, got {value!r}")
        fields["transport"] = value
    try:
        return msgspec.convert(fields, ConnectorConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid kv_connector_extra_config: {exc}") from None


# vLLM 0.34's engine arguments that keep its extensible KV cache off; ipc then shares D's KV by legacy CUDA IPC.
NO_EXTENSIBLE_KV_CACHE = ("--kv-cache-memory-bytes", "--num-gpu-blocks-override", "--no-enable-extensible-kv-cache")


def extensible_kv_cache_off(engine_args: Sequence[str]) -> bool:
    """Whether an argument among `engine_args` fixes the KV cache's size or turns vLLM 0.34's extensible cache off. Pure."""
    return any(a.split("=", 1)[0] in NO_EXTENSIBLE_KV_CACHE for a in engine_args)


def ipc_handles_for(engine_args: Sequence[str]) -> Literal["fd", "legacy"]:
    """How an ipc engine started with `engine_args` shares its KV (`ipc_handles`): by file descriptor, unless an
    argument keeps vLLM's extensible KV cache off (vLLM 0.34 refuses EXPORTS_FD then). Pure."""
    return "legacy" if extensible_kv_cache_off(engine_args) else "fd"


def kv_cache_access(config: ConnectorConfig, *, producer: bool = False, on_gpu: bool = True) -> tuple[str, ...]:
    """The names of the `KVCacheAccess` flags (vLLM 0.34+) the connector declares for `config`'s transport, on P
    (`producer`) or D, its KV cache on a CUDA GPU (`on_gpu`: vLLM's platform) or not; pure.

    tcp/rdma: Mooncake registers the KV memory, each segment must be one allocation (REGISTERS, as vLLM's own
    MooncakeConnector declares). ipc: P maps D's memory, through exported file descriptors (EXPORTS_FD, the
    extensible KV cache kept) or legacy CUDA IPC handles (LEGACY_IPC, the extensible cache off). Anything else
    touches the KV only inside its own process (cma: host memory; socket: its own copies through pinned
    buffers): none (IN_PROCESS), but socket's P on a GPU whose send process may run (socket_send_process not
    false): its child opens P's KV as ipc's P opens D's, so P exports it the same way. Never on a CPU platform,
    where vLLM 0.34 refuses EXPORTS_FD (its extensible KV cache is CUDA's and ROCm's).
    """
    if config.transport in ("tcp", "rdma"):
        return ("REGISTERS",)
    sends = config.transport == "socket" and producer and on_gpu and config.socket_send_process is not False
    if config.transport == "ipc" or sends:
        return ("LEGACY_IPC",) if config.ipc_handles == "legacy" else ("EXPORTS_FD",)
    return ()


def bootstrap_bind(config: ConnectorConfig) -> tuple[str, int]:
    """Where P's TP0 runs the in-worker bootstrap server (vLLM's env var and default port)."""
    port = int(os.environ.get(PORT_ENV, DEFAULT_PORT))
    return "0.0.0.0", port


def bootstrap_url(config: ConnectorConfig, host: str) -> str:
    """The URL P's workers register with: the standalone server if given, else the in-worker one."""
    addr = config.bootstrap_server_address
    if addr is None:
        return f"http://{host}:{bootstrap_bind(config)[1]}"
    return _http(addr)


MEMBERS_URL_ENV = "PDKV_MEMBERS_URL"
ADVERTISE_URL_ENV = "PDKV_ADVERTISE_URL"


def _http(addr: str) -> str:
    return addr if addr.startswith(("http://", "https://")) else f"http://{addr}"


def membership(config: ConnectorConfig, *, is_producer: bool) -> tuple[str, str] | None:
    """(members registry URL, this engine's advertised URL), or None if the engine joins no registry."""
    members = config.members_url or os.environ.get(MEMBERS_URL_ENV) or None
    if members is None and is_producer:
        members = config.bootstrap_server_address
    advertise = config.advertise_url or os.environ.get(ADVERTISE_URL_ENV) or None
    if not members or not advertise:
        return None
    return _http(members).rstrip("/"), _http(advertise).rstrip("/")


Role = Literal["prefill", "decode", "none"]


def classify_params(params: dict[str, Any] | None) -> tuple[Role, PrefillParams | DecodeParams | None]:
    """Read kv_transfer_params as the proxy writes them.

    Returns ("none", None) for a request without P/D params; raises ParamsError
    for params that ask for P/D but are incomplete or contradictory.
    """
    if not params:
        return "none", None
    remote_prefill = params.get("do_remote_prefill")
    remote_decode = params.get("do_remote_decode")
    if remote_prefill and remote_decode:
        raise ParamsError("kv_transfer_params sets both do_remote_prefill and do_remote_decode")
    try:
        if remote_prefill:
            return "decode", msgspec.convert(params, DecodeParams, strict=True)
        if remote_decode:
            return "prefill", msgspec.convert(params, PrefillParams, strict=True)
    except msgspec.ValidationError as exc:
        side = "decode" if remote_prefill else "prefill"
        raise ParamsError(f"invalid kv_transfer_params for a {side} request: {exc}") from None
    return "none", None


def check_decode_params(p: DecodeParams) -> None:
    if not p.transfer_id:
        raise ParamsError("kv_transfer_params.transfer_id is empty")
    if not p.remote_engine_id:
        raise ParamsError("kv_transfer_params.remote_engine_id is empty")
    if not p.remote_bootstrap_addr.startswith(("http://", "https://")):
        raise ParamsError(
            f"kv_transfer_params.remote_bootstrap_addr must be an http(s) URL, got {p.remote_bootstrap_addr!r}"
        )

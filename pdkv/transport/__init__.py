"""KV transport: how bytes move from P's registered memory into D's.

`base` holds the Transport protocol (the one seam every caller uses) and the
descriptor type; `descriptors` turns block ids into descriptors and holds the
range rule every write obeys (pure); `descriptor_writes` is the seam's shared
part for descriptor transports; `mooncake` implements the protocol over
Mooncake's TransferEngine (tcp, rdma); `cuda_ipc` moves KV between GPUs of one
host through CUDA IPC (ipc); `cma` moves KV in host memory between processes
of one host with process_vm_writev (cma); `sockets` moves KV over TCP
connections of pdkv's own, host or GPU memory, across hosts (socket). The
regions a transport moves between are pdkv.wire's `Region`, the type D
announces them in.

Outside this package, import only what `__all__` lists. Importing the package
imports `base` and `descriptors` (pure: msgspec and pdkv's wire); the names of
`mooncake`, `cuda_kernels`, `cma` and `sockets` are imported on first use
(`__getattr__`), and Mooncake, torch and Triton only once a transport starts.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pdkv.errors import StartError
from pdkv.transport.base import Descriptor, Transport
from pdkv.transport.descriptors import block_spans, check_blocks, check_ranges, check_share, plan_descriptors

# How KV moves: "tcp"/"rdma" over Mooncake, "ipc" (CUDA IPC), "cma" (process_vm_writev), "socket" (pdkv's own TCP).
# The connector reads it from kv_connector_extra_config's `mooncake_protocol` (vLLM's key) or `transport`.
TransportName = Literal["tcp", "rdma", "ipc", "cma", "socket"]
TRANSPORTS: tuple[TransportName, ...] = get_args(TransportName)

__all__ = [
    "MAX_SOCKET_CONNECTIONS",
    "TRANSPORTS",
    "Descriptor",
    "Transport",
    "TransportName",
    "block_spans",
    "check_blocks",
    "check_mooncake_transport",
    "check_ranges",
    "check_share",
    "ipc_reachable",
    "link_gbps_of",
    "open_transport",
    "plan_descriptors",
    "ptrace_scope",
    "socket_buffer_problem",
]


def __getattr__(name: str) -> Any:
    """The names imported on first use (PEP 562). Their modules bring a transport's threads, sockets and ctypes,
    which a caller of the pure names (`pdkv up`, the connector's config) does not need."""
    if name in ("check_mooncake_transport", "link_gbps_of"):
        import pdkv.transport.mooncake as home
    elif name == "ipc_reachable":
        import pdkv.transport.cuda_kernels as home
    elif name == "ptrace_scope":
        import pdkv.transport.cma as home
    elif name == "MAX_SOCKET_CONNECTIONS":
        from pdkv.transport.sockets import MAX_CONNECTIONS

        return MAX_CONNECTIONS
    elif name == "socket_buffer_problem":
        from pdkv.transport.sockets import buffer_bytes_problem

        return buffer_bytes_problem
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(home, name)


def open_transport(
    transport: str = "tcp", hostname: str = "127.0.0.1", device: str = "", *, gpu: int | None = None, writable: bool = True,
    port: int = 0, connections: int | None = None, buffer_bytes: int | None = None, send_process: bool = False, **options: Any,
) -> Transport:
    """The one place a transport is chosen: "tcp" or "rdma" over Mooncake, "ipc" (CUDA IPC), "cma" (host memory
    of processes on this host), "socket" (pdkv's TCP, host or GPU memory), for KV on CUDA device `gpu` (None: in
    host memory).

    Raises StartError for a transport that cannot move KV where it lives (ipc needs GPU memory, cma host
    memory). `writable`: peers will write into this process (cma's and socket's D; P passes False). `port` (where
    socket's D listens; 0: a free port), `connections` (to each D) and `buffer_bytes` (each connection's socket
    buffers; None: the transport's default, 0: the kernel's autotuning) and `send_process` (P's writes of GPU
    memory in a child process) are socket's; `options` go to
    MooncakeTransport (settings, write_timeout_s), and write_timeout_s to SocketTransport too.
    Mooncake, torch and Triton are imported here, not when pdkv.transport is imported.
    """
    if transport == "socket":
        from pdkv.transport.sockets import SocketTransport

        given = {"write_timeout_s": options["write_timeout_s"]} if "write_timeout_s" in options else {}
        if buffer_bytes is not None:
            given["buffer_bytes"] = buffer_bytes
        return SocketTransport(hostname, gpu=gpu, writable=writable, port=port, connections=connections or 0,
                               send_process=send_process, **given)
    if transport == "ipc":
        if gpu is None:
            raise StartError("the ipc transport moves KV between GPUs, and this KV cache is in host memory",
                             hint="use cma (one host) or tcp/rdma on CPU hosts")
        from pdkv.transport.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(gpu)
    if transport == "cma":
        if gpu is not None:
            raise StartError("the cma transport moves KV in host memory, and this KV cache is on a GPU",
                             hint="use ipc between GPUs of one host")
        from pdkv.transport.cma import CmaTransport

        return CmaTransport(writable=writable)
    from pdkv.transport.mooncake import MooncakeTransport

    return MooncakeTransport(hostname, transport, device, **options)

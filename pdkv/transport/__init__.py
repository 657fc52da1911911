"""KV transport: how bytes move from P's registered memory into D's.

`base` holds the Transport protocol (the one seam every caller uses) and
region types; `descriptors` turns block ids into descriptors (pure), and
`descriptor_writes` is the seam's shared part for descriptor transports; `mooncake` implements the protocol over
Mooncake's TransferEngine (tcp, rdma); `cuda_ipc` moves KV between
GPUs of one host through CUDA IPC (ipc); `cma` moves KV in host memory
between processes of one host with process_vm_writev (cma); `sockets` moves
KV over TCP connections of pdkv's own, host or GPU memory, across hosts (socket).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pdkv.errors import StartError
from pdkv.transport.base import Transport

# How KV moves: "tcp"/"rdma" over Mooncake, "ipc" (CUDA IPC), "cma" (process_vm_writev), "socket" (pdkv's own TCP).
# The connector reads it from kv_connector_extra_config's `mooncake_protocol` (vLLM's key) or `transport`.
TransportName = Literal["tcp", "rdma", "ipc", "cma", "socket"]
TRANSPORTS: tuple[TransportName, ...] = get_args(TransportName)

__all__ = ["TRANSPORTS", "Transport", "TransportName", "open_transport"]


def open_transport(
    transport: str = "tcp", hostname: str = "127.0.0.1", device: str = "", *, gpu: int | None = None, writable: bool = True,
    port: int = 0, connections: int | None = None, **options: Any,
) -> Transport:
    """The one place a transport is chosen: "tcp" or "rdma" over Mooncake, "ipc" (CUDA IPC), "cma" (host memory
    of processes on this host), "socket" (pdkv's TCP, host or GPU memory), for KV on CUDA device `gpu` (None: in
    host memory).

    Raises StartError for a transport that cannot move KV where it lives (ipc needs GPU memory, cma host
    memory). `writable`: peers will write into this process (cma's and socket's D; P passes False). `port` (where
    socket's D listens; 0: a free port) and `connections` (socket's, to each D) are socket's; `options` go to
    MooncakeTransport (settings, write_timeout_s), and write_timeout_s to SocketTransport too.
    Mooncake, torch and Triton are imported here, not when pdkv.transport is imported.
    """
    if transport == "socket":
        from pdkv.transport.sockets import SocketTransport

        timeout = {"write_timeout_s": options["write_timeout_s"]} if "write_timeout_s" in options else {}
        return SocketTransport(hostname, gpu=gpu, writable=writable, port=port, connections=connections or 0, **timeout)
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

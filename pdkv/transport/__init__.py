"""KV transport: how bytes move from P's registered memory into D's.

`base` holds the Transport protocol and region types; `planner` turns block
ids into descriptors (pure); `mooncake` implements the protocol over
Mooncake's TransferEngine (tcp, rdma); `cuda_ipc` moves KV between
GPUs of one host through CUDA IPC (ipc); `cma` moves KV in host memory
between processes of one host with process_vm_writev (cma).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdkv.transport.cuda_ipc import CudaIpcTransport
    from pdkv.transport.cma import CmaTransport
    from pdkv.transport.mooncake import MooncakeTransport


def open_transport(
    protocol: str = "tcp", hostname: str = "127.0.0.1", device: str = "", *, gpu: int | None = None, **options: Any
) -> MooncakeTransport | CudaIpcTransport | CmaTransport:
    """Start the transport for `protocol` on `hostname`: "tcp" or "rdma" over Mooncake, "ipc" (CUDA IPC on GPU
    `gpu`), or "cma" (host memory of processes on this host).

    `options` go to MooncakeTransport (settings, write_timeout_s). Mooncake,
    torch and Triton are imported here, not when pdkv.transport is imported.
    """
    if protocol == "ipc":
        from pdkv.transport.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(0 if gpu is None else gpu)
    if protocol == "cma":
        from pdkv.transport.cma import CmaTransport

        return CmaTransport(writable=bool(options.get("writable", True)))
    from pdkv.transport.mooncake import MooncakeTransport

    return MooncakeTransport(hostname, protocol, device, **options)

"""KV transport: how bytes move from P's registered memory into D's.

`base` holds the Transport protocol and region types; `planner` turns block
ids into descriptors (pure); `mooncake` implements the protocol over
Mooncake's TransferEngine (tcp, rdma).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdkv.transport.mooncake import MooncakeTransport


def open_transport(protocol: str = "tcp", hostname: str = "127.0.0.1", device: str = "", **options: Any) -> MooncakeTransport:
    """Start the transport for `protocol` ("tcp" or "rdma", both over Mooncake) on `hostname`.

    `options` go to MooncakeTransport (settings, write_timeout_s). The
    Mooncake import happens here, not when pdkv.transport is imported.
    """
    from pdkv.transport.mooncake import MooncakeTransport

    return MooncakeTransport(hostname, protocol, device, **options)

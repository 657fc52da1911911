"""The `socket` transport: KV over TCP connections of pdkv's own, for hosts without RDMA.

`wire` holds the frames, the handshake's proofs and the grant table (pure); `streams` moves a write's bytes between
memory and a socket (host memory in place), `staging` GPU memory through pinned buffers; `listener` is D's side,
`lanes` P's, and `transport` the Transport seam over both. `send_process` runs P's writes of GPU memory in a child
(`send_main`), the two speaking `send_wire`. docs/socket.md describes the wire.
"""

from __future__ import annotations

from pdkv.transport.sockets.transport import MAX_CONNECTIONS, SocketTransport, buffer_bytes_problem

__all__ = ["MAX_CONNECTIONS", "SocketTransport", "buffer_bytes_problem"]

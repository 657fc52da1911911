"""KV transport: how bytes move from P's registered memory into D's.

`base` holds the Transport protocol and region types; `planner` turns block
ids into descriptors (pure); `mooncake` implements the protocol over
Mooncake's TransferEngine (tcp, rdma).
"""

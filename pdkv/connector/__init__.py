"""pdkv's KV connector for vLLM.

Loaded by vLLM through
`--kv-transfer-config '{"kv_connector":"PdkvConnector","kv_connector_module_path":"pdkv.connector",...}'`.
`PdkvConnector` is imported lazily so the pure parts (state, config,
side-channel messages) load without vLLM.

    state.py         per-transfer state machines (pure)
    config.py        kv_connector_extra_config and kv_transfer_params (pure)
    side_channel.py  ZMQ ROUTER/DEALER on a private asyncio loop
    sender.py        P's worker: hold blocks, push them to D
    receiver.py      D's worker: ask P, wait within bounds
    timing.py        per-transfer traces and metrics
    layout.py        vLLM KV tensors -> transport regions
    scheduler.py     scheduler-side hooks
    worker.py        worker-side hooks
    vllm_connector.py  the KVConnectorBase_V1 subclass
"""

from __future__ import annotations

from typing import Any

__all__ = ["PdkvConnector"]


def __getattr__(name: str) -> Any:
    if name == "PdkvConnector":
        from pdkv.connector.vllm_connector import PdkvConnector

        return PdkvConnector
    raise AttributeError(f"module 'pdkv.connector' has no attribute {name!r}")

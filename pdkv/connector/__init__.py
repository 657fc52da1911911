"""pdkv's KV connector for vLLM.

Loaded by vLLM through
`--kv-transfer-config '{"kv_connector":"PdkvConnector","kv_connector_module_path":"pdkv.connector",...}'`.
`PdkvConnector` is imported on first use, so the pure modules load without vLLM (or torch). Outside this package,
import only what `__all__` lists: besides `PdkvConnector`, what `pdkv up` must agree on with the connector it
starts (the environment it hands an engine, how an engine's arguments decide the ipc sharing mode, the layer
groups a deployment file may ask for).

    config.py          kv_connector_extra_config and kv_transfer_params (pure)
    send_table.py      P's per-transfer state machine, SendTable (pure)
    pulls.py           D's pulls: PullSpec, PullTracker (pure)
    checks.py          what P checks of an announcement and a pull (pure)
    layout.py          vLLM KV tensors -> transport regions, start-up refusals
    side_channel.py    the side channel's server (P) and peer (D) on a private asyncio loop
                       (its wire and one-shot client: pdkv.wire.side_channel)
    registration.py    the standing registrations with the bootstrap server
    sender.py          P's worker: hold blocks, push them to D
    writers.py         P's writes of one transfer, on a thread pool per D
    layer_writes.py    which layers of a forward are ready for a write layer by layer (socket_write_layers)
    receiver.py        D's worker: ask P, wait within bounds
    timing.py          per-transfer traces and metrics
    scheduler.py       scheduler-side hooks
    worker.py          worker-side hooks
    vllm_connector.py  the KVConnectorBase_V1 subclass
"""

from __future__ import annotations

from typing import Any

from pdkv.connector.config import (
    ADVERTISE_URL_ENV,
    DEFAULT_LAYER_GROUPS,
    MEMBERS_URL_ENV,
    extensible_kv_cache_off,
    ipc_handles_for,
    layer_groups_problem,
)

__all__ = ["ADVERTISE_URL_ENV", "DEFAULT_LAYER_GROUPS", "MEMBERS_URL_ENV", "PdkvConnector", "extensible_kv_cache_off",
           "ipc_handles_for", "layer_groups_problem"]


# PdkvConnector subclasses vLLM's connector base, and the pure modules must load where vLLM is not installed
# (`pdkv up`, the unit tests): it is imported on first use (PEP 562).
def __getattr__(name: str) -> Any:
    if name == "PdkvConnector":
        from pdkv.connector.vllm_connector import PdkvConnector

        return PdkvConnector
    raise AttributeError(f"module 'pdkv.connector' has no attribute {name!r}")

"""The deployment file of a local 1P1D on the tiny model, as the e2e tests that start `pdkv up -f` write it.

Every part on 127.0.0.1 and a port of its own (support.ports), P on core 0 and D on core 1, KV over cma:

    ports = write_tiny_deployment(tmp / "deploy.toml", tiny_model, restart="no", proxy={"extra_args": ["--health-interval", "1"]},
                                  tables={"autoscale": {"profile": str(profile), ...}, "autoscale.prefill": {"min": 1, "max": 2}})
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdkv.tinymodel import TINY_KV_CACHE_BYTES
from support.ports import free_port

PARTS = ("bootstrap", "prefill", "decode", "proxy")


def write_tiny_deployment(path: Path, model: Path, *, proxy: Mapping[str, Any] | None = None,
                          tables: Mapping[str, Mapping[str, Any]] | None = None, **settings: Any) -> dict[str, int]:
    """Write the file at `path`; its ports by part (PARTS).

    `settings`: top-level keys beside (or over) the common ones below; `proxy`: keys of [proxy] beside its port;
    `tables`: further tables by name, in order (`autoscale`, then `autoscale.prefill`). The bootstrap's and P's ports
    are each the first of two free ones: the port after is the one pdkv's allocator gives an added P (`[autoscale]`)
    for its HTTP port and its bootstrap."""
    ports = {"bootstrap": free_port(pair=True), "prefill": free_port(pair=True), "decode": free_port(), "proxy": free_port()}
    top = {
        "model": str(model), "served_model_name": "tiny", "transport": "cma", "platform": "cpu", "host": "127.0.0.1",
        "host_ip": "127.0.0.1", "block_size": 32, "max_model_len": 2048, "cpu_kv_cache_bytes": TINY_KV_CACHE_BYTES, **settings,
    }
    lines = [*_keys(top), "[bootstrap]", *_keys({"port": ports["bootstrap"]}),
             "[[prefill]]", *_keys({"port": ports["prefill"], "omp_bind": "0"}),
             "[[decode]]", *_keys({"port": ports["decode"], "omp_bind": "1"}),
             "[proxy]", *_keys({"port": ports["proxy"], **(proxy or {})})]
    for name, keys in (tables or {}).items():
        lines += [f"[{name}]", *_keys(keys)]
    path.write_text("\n".join(lines) + "\n")
    return ports


def _keys(keys: Mapping[str, Any]) -> list[str]:
    # Python reads TOML (tomllib) but writes none, and pdkv depends on no TOML writer. The values here are strings,
    # numbers, booleans and lists of them, whose JSON text is also their TOML text.
    return [f"{key} = {json.dumps(str(value) if isinstance(value, Path) else value)}" for key, value in keys.items()]

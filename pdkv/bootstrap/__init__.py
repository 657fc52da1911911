"""The engine registry every P/D pair relies on: which prefill engine holds each
DP rank and where each of its TP/PP workers listens for its side channel, and
which engines serve the deployment now (live membership).

- `registry`: the pure state and rules (`BootstrapRegistry`);
- `members`: the members registry's state (`MemberTable`); its messages are pdkv.wire's;
- `server`: the aiohttp app: `start_background` (on a daemon thread), `run_server` (until a signal: `pdkv
  bootstrap`), `ProbePolicy` (when a registered engine counts as dead);
- `client`: `BootstrapClient` and `AsyncBootstrapClient`.

Outside this package, import only what `__all__` lists. Importing this package imports neither aiohttp nor httpx:
the server's and the clients' names are imported on first use.
"""

from __future__ import annotations

from typing import Any

from pdkv.auth import TOKEN_ENV  # the deployment key, which guards the write endpoints

DEFAULT_PORT = 8998  # vLLM's default for VLLM_MOONCAKE_BOOTSTRAP_PORT
PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"

__all__ = [
    "DEFAULT_PORT",
    "PORT_ENV",
    "TOKEN_ENV",
    "AsyncBootstrapClient",
    "BootstrapClient",
    "ProbePolicy",
    "run_server",
    "start_background",
]


def __getattr__(name: str) -> Any:
    """The clients (httpx) and the server (aiohttp), imported on first use (PEP 562)."""
    if name in ("AsyncBootstrapClient", "BootstrapClient"):
        import pdkv.bootstrap.client as home
    elif name in ("ProbePolicy", "run_server", "start_background"):
        import pdkv.bootstrap.server as home
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(home, name)

"""The engine registry every P/D pair relies on: which prefill engine holds each
DP rank and where each of its TP/PP workers listens for its side channel.

- `registry`: the pure state and rules (`BootstrapRegistry`);
- `server`: the aiohttp app (`make_app`, `start_background`, `run`);
- `client`: `BootstrapClient` and `AsyncBootstrapClient`.

Importing this package imports neither aiohttp nor httpx.
"""

DEFAULT_PORT = 8998  # vLLM's default for VLLM_MOONCAKE_BOOTSTRAP_PORT
PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
# The deployment key (pdkv.auth) guards the write endpoints.
from pdkv.auth import TOKEN_ENV  # noqa: E402

__all__ = ["DEFAULT_PORT", "PORT_ENV", "TOKEN_ENV"]

"""The engine registry every P/D pair relies on: which prefill engine holds each
DP rank and where each of its TP/PP workers listens for its side channel.

- `registry`: the pure state and rules (`BootstrapRegistry`);
- `server`: the aiohttp app (`make_app`, `start_background`, `run`);
- `client`: `BootstrapClient` and `AsyncBootstrapClient`.

Importing this package imports neither aiohttp nor httpx.
"""

DEFAULT_PORT = 8998  # vLLM's default for VLLM_MOONCAKE_BOOTSTRAP_PORT
PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
TOKEN_ENV = "PDKV_BOOTSTRAP_TOKEN"

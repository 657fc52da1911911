"""`pdkv proxy`: the P/D router.

- `config`: `ProxyConfig` and `build_config` (a TOML file and the command line), pure;
- `routing`: the choice of a prefill engine and a decode server, pure;
- `rewrite`: P's and D's copies of a client's request, pure;
- `backends`: the live view the request path routes by; `health` keeps it current (health rounds, liveness
  probes, members registries), `membership` reads the registries' records;
- `router`: the one routing seam the request path asks (`Route`), round-robin and least-outstanding behind it;
  `kv` (a sub-package), `kv_router`, `kv_self_check`: the kv-aware policy, its parts and its Router;
- `engine_loads`, `engine_tokens`: the engines' load from their /metrics (for the kv-aware policy and the planner's
  `planner_loop`) and a request's token ids from their /tokenize, both through pdkv.engine_api over the proxy's pools;
- `http`, `listener`, `exchanges`: the upstream client, the server protocol, one request's two exchanges;
- `app`: the request handlers and their lifecycle; `server`: listening, serving, graceful shutdown;
- `error_answers`, `prefill_channel`, `guard`, `metrics`: what a client is told when a request fails, what P's
  connector is asked, who may use which route, the Prometheus metrics.
"""

from pdkv.proxy.app import ProxyApp
from pdkv.proxy.config import KvConnector, Policy, PrefillSpec, ProxyConfig, build_config, parse_decode, planner_values
from pdkv.proxy.guard import HttpGuard, load_guard, server_ssl
from pdkv.proxy.server import BackgroundProxy, ProxyServer, serve

__all__ = [
    "BackgroundProxy",
    "HttpGuard",
    "KvConnector",
    "Policy",
    "PrefillSpec",
    "ProxyApp",
    "ProxyConfig",
    "ProxyServer",
    "build_config",
    "load_guard",
    "parse_decode",
    "planner_values",
    "serve",
    "server_ssl",
]

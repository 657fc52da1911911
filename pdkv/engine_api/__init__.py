"""A vLLM engine's own HTTP surface, as every part of pdkv reads it (the proxy, `pdkv up`, status, top, trace,
the planner's profile).

- `readings`: one scrape of /metrics read by name (`EngineMetrics`, `EngineLoad`), pure;
- `client`: `EngineClient` and `AsyncEngineClient` (GET /health, GET /metrics, POST /tokenize), and the
  `EngineTransport` seam the proxy's own upstream connections plug into.

Importing this package imports httpx and msgspec, not vLLM.
"""

from pdkv.engine_api.client import (
    CHAT_FIELDS,
    HEALTH_PATH,
    METRICS_PATH,
    TOKENIZE_PATH,
    AsyncEngineClient,
    ChatTokenize,
    CompletionTokenize,
    EngineClient,
    EngineTransport,
    HttpxTransport,
    TokenizeAnswer,
)
from pdkv.engine_api.readings import LOAD_NAMES, EngineLoad, EngineMetrics, parse_engine_load

__all__ = [
    "CHAT_FIELDS",
    "HEALTH_PATH",
    "LOAD_NAMES",
    "METRICS_PATH",
    "TOKENIZE_PATH",
    "AsyncEngineClient",
    "ChatTokenize",
    "CompletionTokenize",
    "EngineClient",
    "EngineLoad",
    "EngineMetrics",
    "EngineTransport",
    "HttpxTransport",
    "TokenizeAnswer",
    "parse_engine_load",
]

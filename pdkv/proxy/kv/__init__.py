"""The kv-aware policy's parts below its facade (pdkv.proxy.kv_router): what each engine has cached, and the choice.

- `events`: vLLM's KV cache events decoded into pdkv's records (pure);
- `subscriber`: one thread following every engine's events over ZMQ into the index (I/O);
- `prefix`: the proxy's own key space for cached blocks, a chained hash over token ids (pure);
- `index`: which blocks each engine holds, reported and predicted (pure, clock passed in);
- `tokenize`: a model's tokenizer and chat template in the proxy, no engine round trip;
- `policy`: the cost model that picks D, P, or D alone (pure);
- `metrics`: the policy's Prometheus metrics, and `counter_delta` for an engine's own counters (read through
  pdkv.engine_api).

This package imports nothing else of pdkv.proxy.
"""

from pdkv.proxy.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch, decode_batch, parse_seq
from pdkv.proxy.kv.index import Hits, KvIndex
from pdkv.proxy.kv.metrics import KvMetrics, counter_delta
from pdkv.proxy.kv.policy import (
    DecodeCandidate,
    KvConfig,
    KvWeights,
    PrefillCandidate,
    Placement,
    RouteReason,
    hit_tokens,
    place_request,
)
from pdkv.proxy.kv.prefix import ROOT_KEY, BlockKey, block_keys, cacheable_blocks, chain_key
from pdkv.proxy.kv.subscriber import EventSource, KvEventSubscriber, StreamObserver
from pdkv.proxy.kv.tokenize import LocalTokenizer, completion_prompt

__all__ = [
    "ROOT_KEY",
    "AllBlocksCleared",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "DecodeCandidate",
    "Event",
    "EventBatch",
    "EventSource",
    "Hits",
    "KvConfig",
    "KvEventSubscriber",
    "KvIndex",
    "KvMetrics",
    "KvWeights",
    "LocalTokenizer",
    "PrefillCandidate",
    "Placement",
    "RouteReason",
    "StreamObserver",
    "block_keys",
    "cacheable_blocks",
    "chain_key",
    "completion_prompt",
    "counter_delta",
    "decode_batch",
    "hit_tokens",
    "parse_seq",
    "place_request",
]

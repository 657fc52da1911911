"""The `kv-aware` policy's cost model: which D, whether D computes the prompt alone, which P (pure).

All costs are in prompt tokens of work.

- D first. D's cost = its requests in flight x `decode_load_tokens` (what one
  more running request costs the others) + its KV usage x `kv_usage_tokens`
  + the prompt tokens D lacks x `decode_miss_weight` (pdkv's connector pulls
  only the blocks D does not hold, pdkv.connector.scheduler._pull_spec, so a
  partial hit on D shortens the transfer).
- Conditional disaggregation: when the chosen D lacks at most
  `local_prefill_tokens` of the prompt, D computes the rest itself and P and
  the transfer are skipped (multi-turn chat where D holds the history, or a
  prompt too short to be worth a transfer).
- Otherwise, when some P holds part of the prompt, P's cost = the prompt
  tokens P would compute (those it does not hold) + `queue_weight` x the
  prefill tokens this proxy sent there whose KV has not reached D yet.
- When no P holds any of it (or its tokens are unknown), there is no prefix
  to gain and P is chosen as least-outstanding chooses it: the fewest
  requests in flight there through this proxy, each counted until its last
  byte, so kv-aware routes as least-outstanding does where it has no gain.

Ties go to the first candidate at or after `start` (a round-robin cursor), so
equal engines share the load.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from pdkv.proxy.kv.prefix import cacheable_blocks


class RouteReason(enum.StrEnum):
    LOCAL_PREFILL = "local_prefill"  # D holds enough of the prompt: D alone
    PREFIX_HIT = "prefix_hit"  # P/D, the chosen P holds part of the prompt
    LEAST_COST = "least_cost"  # P/D, the chosen P holds none of it: by load
    UNKEYED = "unkeyed"  # the prompt's tokens are unknown: by load alone


class KvWeights(msgspec.Struct, frozen=True, kw_only=True):
    queue_weight: float = 1.0
    decode_load_tokens: float = 256.0
    kv_usage_tokens: float = 2048.0
    decode_miss_weight: float = 0.25
    local_prefill_tokens: int = 128  # 0: never skip P


class PrefillCandidate(msgspec.Struct, frozen=True):
    hit_blocks: int  # leading blocks of the prompt it holds (reported + predicted)
    queued_tokens: int  # prefill tokens this proxy has sent it whose KV has not reached D yet
    outstanding: int = 0  # requests in flight there through this proxy, first byte to last


class DecodeCandidate(msgspec.Struct, frozen=True):
    hit_blocks: int
    outstanding: int  # requests in flight there through this proxy
    kv_usage: float = 0.0  # 0..1, as the engine last reported it


class Placement(msgspec.Struct, frozen=True):
    decode: int
    prefill: int | None  # None: D computes the prompt alone
    reason: RouteReason
    prompt_tokens: int
    p_hit_tokens: int = 0
    d_hit_tokens: int = 0
    p_costs: tuple[float, ...] = ()
    d_costs: tuple[float, ...] = ()
    p_by_load: bool = False  # p_costs are the Ps' requests in flight (no P holds any of the prompt)

    def summary(self) -> str:
        """One line for the request's trace: why it went where it went."""
        d = f"D{self.decode} holds {self.d_hit_tokens}/{self.prompt_tokens} tokens"
        costs = f"D costs {_fmt(self.d_costs)}"
        if self.prefill is None:
            return f"{self.reason}: {d}; {costs}"
        p_costs = f"P in flight {_fmt(self.p_costs)}" if self.p_by_load else f"P costs {_fmt(self.p_costs)}"
        return f"{self.reason}: P{self.prefill} holds {self.p_hit_tokens}/{self.prompt_tokens}; {d}; {p_costs}; {costs}"


def _fmt(costs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{c:.0f}" for c in costs) + "]"


def hit_tokens(hit_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Tokens an engine can take from its cache: whole blocks, and never the block with the prompt's last token."""
    return max(0, min(hit_blocks, cacheable_blocks(prompt_tokens, block_size))) * block_size


def _argmin(costs: Sequence[float], start: int) -> int:
    n = len(costs)
    best = start % n
    for k in range(1, n):
        i = (start + k) % n
        if costs[i] < costs[best]:
            best = i
    return best


def decode_cost(c: DecodeCandidate, prompt_tokens: int, block_size: int, w: KvWeights) -> float:
    missing = prompt_tokens - hit_tokens(c.hit_blocks, block_size, prompt_tokens)
    return c.outstanding * w.decode_load_tokens + c.kv_usage * w.kv_usage_tokens + missing * w.decode_miss_weight


def prefill_cost(c: PrefillCandidate, prompt_tokens: int, block_size: int, w: KvWeights) -> float:
    return prompt_tokens - hit_tokens(c.hit_blocks, block_size, prompt_tokens) + w.queue_weight * c.queued_tokens


def place_request(
    prompt_tokens: int,
    block_size: int,
    prefills: Sequence[PrefillCandidate],
    decodes: Sequence[DecodeCandidate],
    weights: KvWeights,
    *,
    start: int = 0,
    keyed: bool = True,
) -> Placement:
    """Where one request goes. `prefills` may be empty (then D computes alone); `decodes` may not."""
    if not decodes:
        raise ValueError("no decode candidates")
    d_costs = tuple(decode_cost(c, prompt_tokens, block_size, weights) for c in decodes)
    d = _argmin(d_costs, start)
    d_hit = hit_tokens(decodes[d].hit_blocks, block_size, prompt_tokens)
    missing = prompt_tokens - d_hit
    if (keyed and missing <= weights.local_prefill_tokens) or not prefills:
        reason = RouteReason.LOCAL_PREFILL if keyed else RouteReason.UNKEYED
        return Placement(d, None, reason, prompt_tokens, d_hit_tokens=d_hit, d_costs=d_costs)
    by_load = not (keyed and any(hit_tokens(c.hit_blocks, block_size, prompt_tokens) > 0 for c in prefills))
    if by_load:  # nothing to gain anywhere: as least-outstanding
        p_costs = tuple(float(c.outstanding) for c in prefills)
    else:
        p_costs = tuple(prefill_cost(c, prompt_tokens, block_size, weights) for c in prefills)
    p = _argmin(p_costs, start)
    p_hit = hit_tokens(prefills[p].hit_blocks, block_size, prompt_tokens)
    if not keyed:
        reason = RouteReason.UNKEYED
    else:
        reason = RouteReason.PREFIX_HIT if p_hit > 0 else RouteReason.LEAST_COST
    return Placement(d, p, reason, prompt_tokens, p_hit, d_hit, p_costs, d_costs, by_load)


class KvConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The kv-aware policy's settings (`[kv]` in the proxy's TOML file, `--kv-*` and `--local-prefill-tokens` flags)."""

    # "ENGINE_URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]": where each engine publishes its KV events.
    events: list[str] = []
    local_prefill_tokens: int = 128  # chosen by benchmarks/routing.py (docs/bench.md)
    queue_weight: float = 1.0
    decode_load_tokens: float = 256.0
    kv_usage_tokens: float = 2048.0
    decode_miss_weight: float = 0.25
    block_size: int | None = None  # None: learned from the engines' events
    predict_ttl_s: float = 10.0
    approximate_ttl_s: float = 120.0
    silent_after_s: float = 5.0
    tokenize_timeout_s: float = 2.0
    metrics_interval_s: float = 1.0  # how often each engine's /metrics is read (D's load and KV usage); 0: never
    tokenizer: str | None = None  # a model folder: the proxy tokenizes itself (pdkv.proxy.kv.tokenize); None: the engines' /tokenize
    self_check: bool = True

    def weights(self) -> KvWeights:
        return KvWeights(queue_weight=self.queue_weight, decode_load_tokens=self.decode_load_tokens, kv_usage_tokens=self.kv_usage_tokens,
                         decode_miss_weight=self.decode_miss_weight, local_prefill_tokens=self.local_prefill_tokens)

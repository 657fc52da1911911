"""The proxy's own key space for cached KV blocks: a chained hash over token-id blocks (pure).

vLLM names a cached block by a hash seeded per deployment (NONE_HASH, the
hash function, PYTHONHASHSEED): the proxy cannot recompute it without
running vLLM's code with vLLM's seed. It does not need to. A BlockStored
event carries the block's token ids and its parent's engine hash, so the
proxy chains its own key over the same token blocks; a request's keys come
from the token ids the engine will see. Same tokens at the same position in
the same chain give the same key, on every engine and in every proxy.

    key(block 0)   = H(ROOT,            tokens[0:B],  extra_0)
    key(block i)   = H(key(block i-1),  tokens[iB:(i+1)B], extra_i)

`extra` carries what vLLM also folds into a block's hash (LoRA name,
multimodal identifiers, cache_salt), so a block stored under a LoRA never
matches the same tokens without it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

BlockKey = int  # the proxy's name for one cached block (64 bits)
ROOT_KEY: BlockKey = 0x7064_6B76_7072_6678  # "pdkvprfx": the parent of every chain's first block


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return array("q", tokens).tobytes()
    except (OverflowError, TypeError):
        return repr(list(tokens)).encode()


def chain_key(parent: BlockKey, tokens: Sequence[int], extra: Any = None) -> BlockKey:
    """The key of the block holding `tokens` whose previous block in the chain is `parent`."""
    h = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    h.update(_tokens_bytes(tokens))
    if extra:
        h.update(b"\x00extra" + repr(extra).encode())
    return int.from_bytes(h.digest(), "big")


def block_keys(token_ids: Sequence[int], block_size: int, *, extra: Any = None, parent: BlockKey = ROOT_KEY) -> list[BlockKey]:
    """Keys of the full blocks of `token_ids` (a trailing partial block is never cached, so it has none).

    `extra` (LoRA name, cache salt) is folded into every block, as vLLM folds the LoRA into each.
    """
    if block_size <= 0:
        raise ValueError(f"block size {block_size} must be positive")
    keys: list[BlockKey] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_key(parent, token_ids[start : start + block_size], extra)
        keys.append(parent)
    return keys


def cacheable_blocks(prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's blocks an engine can take from its cache: vLLM recomputes at least the last
    token (it needs its logits), so a prompt of exactly k full blocks can hit only k - 1 of them."""
    if prompt_tokens <= 0 or block_size <= 0:
        return 0
    return (prompt_tokens - 1) // block_size

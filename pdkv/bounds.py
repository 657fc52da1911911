"""The bounds every number pdkv decodes carries: each wire type of pdkv.wire is built from these.

Every number on every wire pdkv decodes has one of these types, so a frame
or body with an out-of-range value fails decoding (msgspec names the field)
before any state is touched. msgspec checks integer bounds only within int64.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_RANK = 65536  # dp/tp/pp ranks lie in [0, MAX_RANK); the largest deployments use a few hundred
BLOCK_LIMIT = 2**31  # block ids and counts: vLLM's block tables are int32
ADDRESS_LIMIT = 2**64  # a region or range must end at or below this (see check_span)
INT64_MAX = 2**63 - 1
UNIX_TIME_LIMIT = 2.0**34  # unix seconds (the year 2514): rejects NaN, inf and garbage timestamps
MAX_WAIT_S = 7 * 86_400.0  # any wait bound P reports; P's own expiries are minutes
MAX_N_SEQUENCES = 16384  # vLLM's default VLLM_MAX_N_SEQUENCES, the most choices it samples per request

Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANK)]
RankCount = Annotated[int, msgspec.Meta(gt=0, le=MAX_RANK)]
KvHeads = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK)]  # a model's KV heads, all TP ranks together; 0: unknown
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=BLOCK_LIMIT)]
BlockCount = Annotated[int, msgspec.Meta(gt=0, le=BLOCK_LIMIT)]
# Addresses travel only in msgpack frames, which cannot carry an integer past 2**64 - 1: that is
# their upper bound, and check_span bounds where a region ends.
Address = Annotated[int, msgspec.Meta(ge=0)]
Length = Annotated[int, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]  # bytes, descriptors, tokens, entries
UnixTime = Annotated[float, msgspec.Meta(ge=0.0, lt=UNIX_TIME_LIMIT)]
WaitSeconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_WAIT_S)]
HttpStatus = Annotated[int, msgspec.Meta(ge=100, le=999)]  # any three-digit code a backend may send
Binding = Annotated[str, msgspec.Meta(max_length=64, pattern="^[0-9a-f]*$")]  # hex of a binding secret or commitment


def check_span(what: str, base: int, length: int) -> None:
    """Raise ValueError naming `what` when [base, base + length) runs past the 64-bit address space.

    Called from __post_init__, so msgspec turns it into a ValidationError while decoding.
    """
    if base + length > ADDRESS_LIMIT:
        raise ValueError(f"{what} ends past 2**64 (base {base:#x}, {length} bytes)")

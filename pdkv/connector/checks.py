"""What P checks of a pull before it waits on it: pure, so each refusal is a unit test."""

from __future__ import annotations

from pdkv.errors import TransferError
from pdkv.protocol import PullRequest
from pdkv.transport.base import Region
from pdkv.transport.planner import check_blocks


def check_pull(req: PullRequest, regions: list[Region], tp_rank: int, tp_size: int) -> str | None:
    """Why P must refuse this pull before waiting on it, or None. Pure."""
    if req.tp_size != tp_size:
        return f"decode TP size {req.tp_size} differs from prefill TP size {tp_size} (unequal TP is not supported)"
    if req.tp_rank != tp_rank:
        return f"pull for TP rank {req.tp_rank} reached prefill TP rank {tp_rank}"
    if len(req.regions) != len(regions):
        return f"decode has {len(req.regions)} KV regions, prefill {len(regions)}: the models or layouts differ"
    for i, (theirs, ours) in enumerate(zip(req.regions, regions, strict=True)):
        if theirs.block_len != ours.block_len:
            return f"region {i}: decode block is {theirs.block_len} B, prefill {ours.block_len} B: block size, dtype or model differ"
        try:
            check_blocks(req.block_ids, theirs.num_blocks, "decode")
        except TransferError as exc:
            return str(exc)
    if len(set(req.block_ids)) != len(req.block_ids):
        return "decode block ids repeat"
    return None

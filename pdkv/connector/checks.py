"""What P checks of an announcement and of a pull before it waits on either: pure, so each refusal is a unit test.

The rule for memory (pdkv.transport.planner.check_ranges): P reads only its own
KV regions and writes only inside the regions D announced for the session a
pull names; a pull names blocks, never addresses.
"""

from __future__ import annotations

from pdkv.errors import TransferError
from pdkv.protocol import Announce, PullRequest
from pdkv.transport.base import Region
from pdkv.transport.planner import check_blocks


def _check_tp(tp_rank: int, tp_size: int, ours_rank: int, ours_size: int) -> str | None:
    if tp_size != ours_size:
        return f"decode TP size {tp_size} differs from prefill TP size {ours_size} (unequal TP is not supported)"
    if tp_rank != ours_rank:
        return f"decode TP rank {tp_rank} reached prefill TP rank {ours_rank}"
    return None


def check_announce(a: Announce, regions: list[Region], tp_rank: int, tp_size: int) -> str | None:
    """Why P must refuse D's announced regions (the models or layouts differ), or None. Pure."""
    why = _check_tp(a.tp_rank, a.tp_size, tp_rank, tp_size)
    if why is not None:
        return why
    if len(a.regions) != len(regions):
        return f"decode has {len(a.regions)} KV regions, prefill {len(regions)}: the models or layouts differ"
    for i, (theirs, ours) in enumerate(zip(a.regions, regions, strict=True)):
        if theirs.block_len != ours.block_len:
            return f"region {i}: decode block is {theirs.block_len} B, prefill {ours.block_len} B: block size, dtype or model differ"
    return None


def check_pull(req: PullRequest, announced: Announce | None, tp_rank: int, tp_size: int) -> str | None:
    """Why P must refuse this pull before waiting on it, or None: `announced` is what D announced for
    `req.session` (None: nothing). The full range rule runs again when P's blocks are known. Pure."""
    why = _check_tp(req.tp_rank, req.tp_size, tp_rank, tp_size)
    if why is not None:
        return why
    if announced is None:
        return f"decode at {req.session} has not announced its KV regions on this connection"
    if announced.regions:
        try:
            check_blocks(req.block_ids, min(r.num_blocks for r in announced.regions), "decode")
        except TransferError as exc:
            return str(exc)
    if len(set(req.block_ids)) != len(req.block_ids):
        return "decode block ids repeat"
    return None

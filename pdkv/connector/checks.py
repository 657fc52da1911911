"""What P checks of an announcement and of a pull before it waits on either: pure, so each refusal is a unit test.

The rule for memory (pdkv.transport.check_ranges): P reads only its own
KV regions and writes only inside the regions D announced for the session a
pull names; a pull names blocks, never addresses.
"""

from __future__ import annotations

from pdkv.errors import TransferError
from pdkv.wire import Announce, PullRequest, Region
from pdkv.transport import check_blocks, check_share
from pdkv.tp_heads import HeadShare, head_shares


def announced_share(a: Announce, tp_rank: int, tp_size: int, kv_heads: int = 0) -> HeadShare | None:
    """The heads this P rank (`tp_rank` of `tp_size`, a model of `kv_heads` KV heads; 0: unknown) writes into each
    of the announcing D rank's blocks: None for a D of P's own TP size (whole blocks, rank r to rank r). Raises
    TransferError saying why P must refuse D. Pure."""
    if a.tp_size == tp_size:
        if a.tp_rank != tp_rank:
            raise TransferError(f"decode TP rank {a.tp_rank} reached prefill TP rank {tp_rank}")
        if a.kv_heads and kv_heads and a.kv_heads != kv_heads:
            raise TransferError(f"decode's model has {a.kv_heads} KV heads, prefill's {kv_heads}: the models differ")
        return None
    if not a.kv_heads or not kv_heads:
        silent = "decode" if not a.kv_heads else "prefill"
        raise TransferError(
            f"decode TP size {a.tp_size} differs from prefill TP size {tp_size}, and {silent} did not say how many KV heads "
            "the model has (unequal TP needs it to split the heads)"
        )
    if a.kv_heads != kv_heads:
        raise TransferError(f"decode's model has {a.kv_heads} KV heads, prefill's {kv_heads}: the models differ")
    share = head_shares(kv_heads, tp_size, a.tp_size, a.tp_rank).get(tp_rank)
    if share is None:
        raise TransferError(f"decode TP rank {a.tp_rank} of {a.tp_size} takes no KV heads from prefill TP rank {tp_rank} of {tp_size}")
    return share


def check_announce(a: Announce, regions: list[Region], tp_rank: int, tp_size: int, kv_heads: int = 0) -> str | None:
    """Why P must refuse D's announced regions (the models, layouts or TP sizes do not fit), or None. Pure."""
    try:
        share = announced_share(a, tp_rank, tp_size, kv_heads)
    except TransferError as exc:
        return str(exc)
    if len(a.regions) != len(regions):
        return f"decode has {len(a.regions)} KV regions, prefill {len(regions)}: the models or layouts differ"
    if share is not None:
        try:
            check_share(share, regions, a.regions)
        except TransferError as exc:
            return str(exc)
        return None
    for i, (theirs, ours) in enumerate(zip(a.regions, regions, strict=True)):
        if theirs.block_len != ours.block_len:
            return f"region {i}: decode block is {theirs.block_len} B, prefill {ours.block_len} B: block size, dtype or model differ"
    return None


def check_pull(req: PullRequest, announced: Announce | None) -> str | None:
    """Why P must refuse this pull before waiting on it, or None: `announced` is what D announced for
    `req.session` (None: nothing), whose TP rank and size the pull must repeat (the announcement was checked
    against this P rank's). The full range rule runs again when P's blocks are known. Pure."""
    if announced is None:
        return f"decode at {req.session} has not announced its KV regions on this connection"
    if (req.tp_rank, req.tp_size) != (announced.tp_rank, announced.tp_size):
        return (f"the pull comes from decode TP rank {req.tp_rank} of {req.tp_size}, but {req.session} announced "
                f"rank {announced.tp_rank} of {announced.tp_size}")
    if announced.regions:
        try:
            check_blocks(req.block_ids, min(r.num_blocks for r in announced.regions), "decode")
        except TransferError as exc:
            return str(exc)
    if len(set(req.block_ids)) != len(req.block_ids):
        return "decode block ids repeat"
    return None

"""Which KV heads each tensor-parallel rank holds, and where a D rank takes its heads from when P's TP differs. Pure.

vLLM splits a model's KV heads evenly over TP ranks while TP does not exceed them, and beyond that gives each
rank one head, replicated on consecutive ranks. A D rank takes each of its heads from the first P rank holding
it: from one P rank when D's TP is larger, from several when P's is. pdkv.transport.descriptors turns a share into
descriptors; pdkv.geometry sizes it.
"""

from __future__ import annotations

from typing import NamedTuple

from pdkv.errors import TransferError


class HeadShare(NamedTuple):
    """The heads one P rank gives one D rank: `count` heads from head `src_first` of P's block (which holds
    `src_heads`) into head `dst_first` of D's block (which holds `dst_heads`)."""

    src_first: int
    dst_first: int
    count: int
    src_heads: int
    dst_heads: int

    @property
    def whole(self) -> bool:
        """Both blocks move whole: the layouts match and runs coalesce as with equal TP."""
        return self.src_first == self.dst_first == 0 and self.count == self.src_heads == self.dst_heads


def rank_heads(total_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first, count): the model's KV heads TP rank `rank` of `tp` holds. Heads split evenly while TP does not
    exceed them; beyond, each rank holds one head, replicated on tp / total_heads consecutive ranks (vLLM's rule).
    Raises TransferError for sizes that cannot be split so."""
    if total_heads <= 0 or tp <= 0 or not 0 <= rank < tp:
        raise TransferError(f"TP rank {rank} of {tp} cannot hold heads of a model with {total_heads} KV heads")
    if tp <= total_heads:
        if total_heads % tp:
            raise TransferError(f"{total_heads} KV heads do not split evenly over TP {tp}")
        count = total_heads // tp
        return rank * count, count
    if tp % total_heads:
        raise TransferError(f"TP {tp} is not a multiple of the {total_heads} KV heads it replicates")
    return rank // (tp // total_heads), 1


def check_tp_pair(p_tp: int, d_tp: int) -> str | None:
    """Why P of TP `p_tp` and D of TP `d_tp` cannot pair, or None: one size must divide the other."""
    if p_tp <= 0 or d_tp <= 0:
        return f"TP sizes must be positive (P {p_tp}, D {d_tp})"
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        return f"TP sizes {p_tp} (P) and {d_tp} (D) do not divide each other, so KV heads cannot be mapped between ranks"
    return None


def head_shares(total_heads: int, p_tp: int, d_tp: int, d_rank: int) -> dict[int, HeadShare]:
    """{P rank: its share}: where D rank `d_rank` takes each of its heads from. Equal TP pairs rank r with rank r;
    otherwise each head comes from the first P rank that holds it. Pure; TransferError for sizes that cannot pair."""
    why = check_tp_pair(p_tp, d_tp)
    if why is not None:
        raise TransferError(why)
    d_first, d_count = rank_heads(total_heads, d_tp, d_rank)
    if p_tp == d_tp:
        return {d_rank: HeadShare(0, 0, d_count, d_count, d_count)}
    out: dict[int, HeadShare] = {}
    for head in range(d_first, d_first + d_count):
        p_rank = next(r for r in range(p_tp) if _holds(total_heads, p_tp, r, head))
        p_first, p_count = rank_heads(total_heads, p_tp, p_rank)
        share = out.get(p_rank)
        if share is None:
            out[p_rank] = HeadShare(head - p_first, head - d_first, 1, p_count, d_count)
        else:
            out[p_rank] = share._replace(count=share.count + 1)
    return out


def _holds(total_heads: int, tp: int, rank: int, head: int) -> bool:
    first, count = rank_heads(total_heads, tp, rank)
    return first <= head < first + count


def pullers(total_heads: int, p_tp: int, d_tp: int, p_rank: int) -> int:
    """How many D ranks take heads from P rank `p_rank`: the pulls each D request makes there (0: none)."""
    return sum(1 for r in range(d_tp) if p_rank in head_shares(total_heads, p_tp, d_tp, r))

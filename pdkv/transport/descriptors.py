"""Descriptor planning: block ids and region layouts in, (src, dst, length) out.

Pure: no I/O, no torch. Runs of blocks that are consecutive on both sides
coalesce into one descriptor per region, so 63 contiguous blocks of a
36-layer model are 36 descriptors, not 2268. Between P and D of different
TP sizes (`HeadShare`) each block moves only the heads one P rank gives one
D rank: one descriptor per region and block.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdkv.errors import TransferError
from pdkv.tp_heads import HeadShare
from pdkv.transport.base import Descriptor, Region


def block_runs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group paired block ids into (local_start, remote_start, count) runs, consecutive on both sides."""
    if len(local) != len(remote):
        raise TransferError(f"{len(local)} local blocks cannot pair with {len(remote)} remote blocks")
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote, strict=True):
        if runs:
            ls, rs, n = runs[-1]
            if lb == ls + n and rb == rs + n:
                runs[-1] = (ls, rs, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs


def block_spans(blocks: Sequence[int], regions: Sequence[Region]) -> list[tuple[int, int]]:
    """The (address, length) spans `blocks` occupy in every region, runs of consecutive ids as one span each: what
    D lets P write for one pull. TransferError for a block id outside the regions."""
    if not regions:
        return []
    check_blocks(blocks, min(r.num_blocks for r in regions), "decode")
    runs = block_runs(blocks, blocks)
    return [(r.base + start * r.block_len, n * r.block_len) for r in regions for start, _, n in runs]


def check_blocks(blocks: Sequence[int], num_blocks: int, side: str) -> None:
    """Refuse a block id outside [0, num_blocks): nothing outside the registered blocks is ever written."""
    for b in blocks:
        if not isinstance(b, int) or isinstance(b, bool) or b < 0 or b >= num_blocks:
            raise TransferError(f"{side} block id {b!r} is outside the {num_blocks} registered blocks")


def check_ranges(
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    local_regions: Sequence[Region],
    remote_regions: Sequence[Region],
    heads: HeadShare | None = None,
) -> None:
    """The one rule every write obeys, whatever the transport: raise TransferError unless every range read lies
    in a local region and every range written lies in the remote region the peer announced.

    Regions pair by position with equal block lengths (with `heads`, a share of unequal TP: blocks of whole
    heads of one size, the share inside both blocks, see check_share); block ids pair one to one; every local id
    is inside every local region, every remote id inside every remote region, and no remote id repeats (two
    sources for one destination). KVSender checks it before a write starts; each transport checks it again on entry.
    """
    if len(local_regions) != len(remote_regions):
        raise TransferError(f"{len(local_regions)} local regions cannot pair with {len(remote_regions)} remote regions")
    if len(local_blocks) != len(remote_blocks):
        raise TransferError(f"{len(local_blocks)} local blocks cannot pair with {len(remote_blocks)} remote blocks")
    if heads is not None:
        check_share(heads, local_regions, remote_regions)
    for i, (lr, rr) in enumerate(zip(local_regions, remote_regions, strict=True)):
        if (heads is None or heads.whole) and lr.block_len != rr.block_len:
            raise TransferError(f"region {i}: block length differs: local {lr.block_len} B, remote {rr.block_len} B")
    if local_regions:
        check_blocks(local_blocks, min(r.num_blocks for r in local_regions), "local")
        check_blocks(remote_blocks, min(r.num_blocks for r in remote_regions), "remote")
    if len(set(remote_blocks)) != len(remote_blocks):
        raise TransferError("remote block ids repeat")


def plan_descriptors(
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
    local_regions: Sequence[Region],
    remote_regions: Sequence[Region],
    *,
    coalesce: bool = True,
    heads: HeadShare | None = None,
) -> list[Descriptor]:
    """Descriptors that copy `local_blocks` of every local region into `remote_blocks` of its remote twin; with
    `heads` (not whole), only that share of each block: one descriptor per region and block, at the share's offset.

    `check_ranges` holds before anything is planned.
    """
    check_ranges(local_blocks, remote_blocks, local_regions, remote_regions, heads)
    if heads is not None and not heads.whole:
        return _plan_share(local_blocks, remote_blocks, local_regions, remote_regions, heads)
    runs = block_runs(local_blocks, remote_blocks)
    if not coalesce:
        runs = [(ls + i, rs + i, 1) for ls, rs, n in runs for i in range(n)]
    out: list[Descriptor] = []
    for lr, rr in zip(local_regions, remote_regions, strict=True):
        bl = lr.block_len
        out.extend(Descriptor(lr.base + ls * bl, rr.base + rs * bl, n * bl) for ls, rs, n in runs)
    return out


def _plan_share(
    local_blocks: Sequence[int], remote_blocks: Sequence[int], local_regions: Sequence[Region], remote_regions: Sequence[Region],
    share: HeadShare,
) -> list[Descriptor]:
    out: list[Descriptor] = []
    for lr, rr in zip(local_regions, remote_regions, strict=True):
        unit = lr.block_len // share.src_heads  # one head's bytes, equal on both sides (check_share)
        src_off, dst_off, length = share.src_first * unit, share.dst_first * unit, share.count * unit
        out.extend(
            Descriptor(lr.base + lb * lr.block_len + src_off, rr.base + rb * rr.block_len + dst_off, length)
            for lb, rb in zip(local_blocks, remote_blocks, strict=True)
        )
    return out


# --- heterogeneous TP: which heads of a block one P rank gives one D rank ---------------------------------------
#
# A TP rank holds a contiguous range of the model's KV heads (one head, replicated, once TP exceeds them), and in
# every layout pdkv accepts the heads are the outermost axis inside a block: LBHNC's block is [H, N, C] with K and V
# inside each head's C, the older [2, B, H, N, D] keeps K and V in two regions whose blocks are [H, N, D]. So the
# heads a D rank takes from one P rank are one contiguous byte range of each block, on both sides: one descriptor per
# (region, block) at an offset, where equal TP moves whole blocks and coalesces runs.


def check_share(share: HeadShare, local_regions: Sequence[Region], remote_regions: Sequence[Region]) -> None:
    """Raise TransferError unless each region pair holds whole heads of one size on both sides and the share lies
    inside both blocks: then every descriptor plan_descriptors makes from it stays inside one block of each side."""
    if share.count <= 0 or share.src_first < 0 or share.dst_first < 0:
        raise TransferError(f"head share {tuple(share)} is empty or negative")
    if share.src_first + share.count > share.src_heads or share.dst_first + share.count > share.dst_heads:
        raise TransferError(
            f"heads {share.src_first}..{share.src_first + share.count - 1} of {share.src_heads} (P) into "
            f"{share.dst_first}.. of {share.dst_heads} (D) leave a block"
        )
    if len(local_regions) != len(remote_regions):
        raise TransferError(f"{len(local_regions)} local regions cannot pair with {len(remote_regions)} remote regions")
    for i, (lr, rr) in enumerate(zip(local_regions, remote_regions, strict=True)):
        if lr.block_len % share.src_heads or rr.block_len % share.dst_heads:
            raise TransferError(
                f"region {i}: a block of {lr.block_len} B (P) or {rr.block_len} B (D) is not "
                f"{share.src_heads} (P) or {share.dst_heads} (D) heads of equal size"
            )
        if lr.block_len // share.src_heads != rr.block_len // share.dst_heads:
            raise TransferError(
                f"region {i}: one head is {lr.block_len // share.src_heads} B of P's block but "
                f"{rr.block_len // share.dst_heads} B of D's: block size, dtype or model differ"
            )

"""Descriptor planning (step 28): block ids and region layouts in, (src, dst, length) out.

Pure: no I/O, no torch. Runs of blocks that are consecutive on both sides
coalesce into one descriptor per region, so 63 contiguous blocks of a
36-layer model are 36 descriptors, not 2268.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdkv.errors import TransferError
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


def check_blocks(blocks: Sequence[int], num_blocks: int, side: str) -> None:
    """Refuse a block id outside [0, num_blocks): nothing outside the registered blocks is ever written."""
    for b in blocks:
        if not isinstance(b, int) or isinstance(b, bool) or b < 0 or b >= num_blocks:
            raise TransferError(f"{side} block id {b!r} is outside the {num_blocks} registered blocks")


def check_ranges(
    local_blocks: Sequence[int], remote_blocks: Sequence[int], local_regions: Sequence[Region], remote_regions: Sequence[Region]
) -> None:
    """The one rule every write obeys, whatever the transport: raise TransferError unless every range read lies
    in a local region and every range written lies in the remote region the peer announced.

    Regions pair by position with equal block lengths; block ids pair one to one; every local id is inside
    every local region, every remote id inside every remote region, and no remote id repeats (two sources
    for one destination). KVSender checks it before a write starts; each transport checks it again on entry.
    """
    if len(local_regions) != len(remote_regions):
        raise TransferError(f"{len(local_regions)} local regions cannot pair with {len(remote_regions)} remote regions")
    if len(local_blocks) != len(remote_blocks):
        raise TransferError(f"{len(local_blocks)} local blocks cannot pair with {len(remote_blocks)} remote blocks")
    for i, (lr, rr) in enumerate(zip(local_regions, remote_regions, strict=True)):
        if lr.block_len != rr.block_len:
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
) -> list[Descriptor]:
    """Descriptors that copy `local_blocks` of every local region into `remote_blocks` of its remote twin.

    `check_ranges` holds before anything is planned.
    """
    check_ranges(local_blocks, remote_blocks, local_regions, remote_regions)
    runs = block_runs(local_blocks, remote_blocks)
    if not coalesce:
        runs = [(ls + i, rs + i, 1) for ls, rs, n in runs for i in range(n)]
    out: list[Descriptor] = []
    for lr, rr in zip(local_regions, remote_regions, strict=True):
        bl = lr.block_len
        out.extend(Descriptor(lr.base + ls * bl, rr.base + rs * bl, n * bl) for ls, rs, n in runs)
    return out

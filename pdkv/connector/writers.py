"""P's writes: one transfer's bytes (`write_transfer`), on threads of one small pool per D, so that a stalled D
holds up only its own transfers."""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from pdkv.connector.layer_writes import LayerCursor
from pdkv.connector.pulls import write_key
from pdkv.connector.send_table import StartSend
from pdkv.errors import TransferError
from pdkv.wire import Announce, PullRequest, Region
from pdkv.transport import Transport, check_ranges

# Writes to one D run on up to this many threads at once; each D has its own.
WRITERS_PER_PEER = 4
MAX_PEER_POOLS = 64


class WriterPools:
    """Thread pools keyed by D session, least recently used first; past MAX_PEER_POOLS the oldest is let go
    (its running writes finish, then its threads end). Safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: OrderedDict[str, concurrent.futures.ThreadPoolExecutor] = OrderedDict()  # guarded by _lock

    def submit(self, session: str, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        with self._lock:
            pool = self._pools.get(session)
            if pool is None:
                pool = self._pools[session] = concurrent.futures.ThreadPoolExecutor(
                    max_workers=WRITERS_PER_PEER, thread_name_prefix="pdkv-send"
                )
                if len(self._pools) > MAX_PEER_POOLS:
                    _, oldest = self._pools.popitem(last=False)
                    oldest.shutdown(wait=False)
            self._pools.move_to_end(session)
            return pool.submit(fn, *args)

    def shutdown(self) -> None:
        """Cancel the writes not yet started; those running finish on their own."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), OrderedDict()
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)


def _checked_blocks(regions: Sequence[Region], a: StartSend) -> list[int]:
    """P's blocks `a`'s pull asks for, after the one range rule (check_ranges) passed for all of them."""
    req: PullRequest = a.pull.request
    want = len(req.block_ids)
    if req.first_block + want > len(a.blocks):
        last = req.first_block + want - 1
        raise TransferError(f"decode asks for blocks {req.first_block}..{last} of a prompt P holds in {len(a.blocks)}")
    local = a.blocks[req.first_block : req.first_block + want]
    check_ranges(local, req.block_ids, regions, a.pull.announced.regions, a.pull.heads)  # before any byte moves
    return local


def write_transfer(
    transport: Transport, regions: Sequence[Region], a: StartSend, fence: Any, event: Callable[..., None]
) -> tuple[int, int]:
    """Write the blocks `a`'s pull asks for into D's announced regions: (bytes, descriptors); raises on failure.

    `fence`: None (the KV is there), or a GPU event of the forward that computed the blocks, which the write
    waits for first. `event(name, **fields)` records the trace's transfer_start, kv_ready and transfer_end."""
    req: PullRequest = a.pull.request
    local = _checked_blocks(regions, a)
    announced: Announce = a.pull.announced
    event("transfer_start", session=req.session)
    if fence is not None:
        fence.synchronize()
        event("kv_ready")
    transport.connect(req.session, announced.ipc)
    out = transport.write_blocks(req.session, local, req.block_ids, regions, announced.regions, a.pull.heads,
                                 transfer=write_key(req.transfer_id, req.d_req_id))
    event("transfer_end")
    return out


def write_layers(
    transport: Transport, regions: Sequence[Region], a: StartSend, cursor: LayerCursor, event: Callable[..., None],
) -> tuple[int, int]:
    """Write the blocks `a`'s pull asks for layer by layer: (bytes, descriptors); raises at the first layer that fails.

    `cursor.next()` gives the layers to write next with their fences ([] once all are taken; it raises when none
    comes in time: LayerBoard.next_layers), `cursor.regions[i]` the indices into `regions` (and D's announced
    regions) of layer i; this thread waits for their fences (the last of them: LayerCursor.last_fence), then writes
    those layers' regions in one write. `event` records transfer_start (the first write begins) and transfer_end (the
    last landed)."""
    req: PullRequest = a.pull.request
    local = _checked_blocks(regions, a)
    announced: Announce = a.pull.announced
    transport.connect(req.session, announced.ipc)
    key = write_key(req.transfer_id, req.d_req_id)
    nbytes = ndesc = 0
    started = False
    while batch := cursor.next():
        if (fence := cursor.last_fence(batch)) is not None:
            fence.synchronize()
        if not started:
            event("transfer_start", session=req.session)
            started = True
        at = [j for i, _ in batch for j in cursor.regions[i]]
        out = transport.write_blocks(req.session, local, req.block_ids, [regions[j] for j in at],
                                     [announced.regions[j] for j in at], a.pull.heads, transfer=key)
        nbytes, ndesc = nbytes + out[0], ndesc + out[1]
    event("transfer_end")
    return nbytes, ndesc

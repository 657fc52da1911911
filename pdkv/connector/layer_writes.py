"""P's write of a prompt's KV layer by layer, during the forward that computes it (`socket_write_layers`).

Which layers of a forward are ready, and which of them each pull's write has taken:

- the model runner's thread opens a forward (`LayerBoard.open`, before it runs) for the transfers whose prompt it
  completes, marks each layer ready as vLLM saves it (`layer_ready`, with a CUDA event recorded after the layer
  on the forward's stream, or None on a CPU, where the KV is there once the layer returned), and closes the
  forward once it is done (`forward_done`: a layer vLLM never reported, as in a replayed CUDA graph, is ready
  with the forward's own event);
- each pull's write (a writer thread, pdkv.connector.writers.write_layers) holds a `LayerCursor` over its
  transfer's forward and takes the layers ready and not yet written (`next_layers`), all of them at once when
  the pull came after the forward, waits for their events itself and writes them, until every layer is written.
  It takes them a group at a time: the layers are cut into `groups` runs of neighbours (`socket_layer_groups`),
  and a group is taken once all of its layers are ready, so that a forward costs a few writes, not one a layer:
  each write's own work (splitting it over the connections, staging, a kernel launch) runs on threads that share
  the interpreter with the model runner's, which launches the forward layer by layer.
  A layer's KV holds the whole prompt's blocks of that layer, those computed before this forward (P's prefix
  cache, earlier chunks) included, so each layer's write moves every block the pull asks for.

A board remembers the forward of each transfer until `drop` (its blocks freed or its request cancelled), at most
MAX_TRANSFERS of them. One lock, `_cond`, guards it all; waits are bounded.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from pdkv.errors import TransferError

MAX_TRANSFERS = 4096  # transfers whose forward a board remembers; past it the oldest is forgotten


def group_ends(layers: int, groups: int) -> list[int]:
    """Where each of `groups` runs of neighbouring layers ends (exclusive), as even as `layers` allows; at most one
    group a layer."""
    groups = max(1, min(groups, layers))
    return [(k + 1) * layers // groups for k in range(groups)]


class ForwardLayers:
    """One forward's layers: `fences[i]` is set once layer i's KV is ready (the event a write waits for first, or
    None); `done` once the forward returned (every layer then ready). Guarded by its board's lock."""

    __slots__ = ("closing", "count", "done", "ends", "fences")

    def __init__(self, count: int, ends: Sequence[int]) -> None:
        self.count = count
        self.ends = ends  # group_ends: a write takes whole groups
        self.fences: dict[int, Any] = {}
        self.done = False
        self.closing: Any = None  # the fence `finish` gave the layers never reported: recorded after every other

    def in_whole_groups(self) -> list[int]:
        """The layers of the groups whose every layer is ready, in order."""
        out: list[int] = []
        start = 0
        for end in self.ends:
            if all(i in self.fences for i in range(start, end)):
                out.extend(range(start, end))
            start = end
        return out

    def mark(self, layer: int, fence: Any) -> bool:
        """Layer `layer` is ready; whether that made its group whole (a write may take it now)."""
        if not 0 <= layer < self.count or layer in self.fences:
            return False
        self.fences[layer] = fence
        at = bisect.bisect_right(self.ends, layer)
        start = self.ends[at - 1] if at else 0
        return all(i in self.fences for i in range(start, self.ends[at]))

    def finish(self, fence: Any) -> None:
        for layer in range(self.count):
            self.fences.setdefault(layer, fence)
        self.closing = fence
        self.done = True


class LayerCursor:
    """One pull's write over a forward's layers: which layers it has taken (guarded by its board's lock), and what
    a layer is (`regions[i]`: the indices into the KV regions of layer i)."""

    __slots__ = ("board", "forward", "regions", "taken")

    def __init__(self, board: LayerBoard, forward: ForwardLayers) -> None:
        self.board = board
        self.forward = forward
        self.regions: Sequence[tuple[int, ...]] = board.regions
        self.taken: set[int] = set()

    def next(self) -> list[tuple[int, Any]]:
        """The layers to write next (LayerBoard.next_layers, within the board's bound)."""
        return self.board.next_layers(self, self.board.wait_s)

    def take(self) -> list[tuple[int, Any]]:
        """The layers of whole ready groups not taken yet, in order, with their fences; they count as taken from now
        on."""
        fresh = [i for i in self.forward.in_whole_groups() if i not in self.taken]
        self.taken.update(fresh)
        return [(i, self.forward.fences[i]) for i in fresh]

    def last_fence(self, batch: Sequence[tuple[int, Any]]) -> Any:
        """The one fence of `batch` (taken layers, in order) whose completion is every one's, or None: the layers'
        events are recorded on the forward's stream in layer order, the forward's closing fence after them all. One
        wait, not one a layer: each is a call that hands the interpreter's lock to the model runner's thread and
        back."""
        with self.board._cond:
            closing = self.forward.closing
        fences = [f for _, f in batch if f is not None]
        if closing is not None and any(f is closing for f in fences):
            return closing
        return fences[-1] if fences else None

    @property
    def finished(self) -> bool:
        """Every layer has been taken."""
        return len(self.taken) >= self.forward.count


class LayerBoard:
    """The forwards whose transfers are written layer by layer, by transfer id. Safe from any thread.

    `regions[i]`: the indices into the KV regions of layer i (pdkv.connector.layout.layer_regions); none: writing
    layer by layer is off, and the board opens no forward. A write takes `groups` runs of neighbouring layers, each
    once all of its layers are ready (group_ends; none: one a layer), and waits at most `wait_s` for the next."""

    def __init__(self, regions: Sequence[tuple[int, ...]] = (), wait_s: float = 30.0, groups: int | None = None) -> None:
        self.regions = list(regions)
        self.layers = len(self.regions)
        self.ends = group_ends(self.layers, groups or self.layers) if self.layers else []
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._current: ForwardLayers | None = None  # guarded by _cond: the forward running now
        self._by_transfer: OrderedDict[str, ForwardLayers] = OrderedDict()  # guarded by _cond
        self._closed = False  # guarded by _cond

    @property
    def on(self) -> bool:
        return self.layers > 0

    def open(self, transfer_ids: Iterable[str], stale_fence: Any = None) -> None:
        """A forward begins that completes the prompts of `transfer_ids`. A forward still open (never closed by
        forward_done) is closed first, ready with `stale_fence`: everything it launched precedes this one."""
        if not self.on:
            return
        forward = ForwardLayers(self.layers, self.ends)
        with self._cond:
            if self._current is not None:
                self._current.finish(stale_fence)
            self._current = forward
            for tid in transfer_ids:
                self._by_transfer[tid] = forward
                self._by_transfer.move_to_end(tid)
            while len(self._by_transfer) > MAX_TRANSFERS:
                self._by_transfer.popitem(last=False)
            self._cond.notify_all()

    def layer_ready(self, layer: int, fence: Any) -> None:
        """Layer `layer` of the running forward has its KV in the cache (`fence`: what a write waits for first). The
        writes waiting wake only when a group became whole: each wake-up takes the interpreter's lock from the model
        runner's thread, which is launching the forward's next layer."""
        with self._cond:
            if self._current is not None and self._current.mark(layer, fence):
                self._cond.notify_all()

    def forward_done(self, fence: Any) -> bool:
        """The running forward returned: its layers not reported are ready with `fence`. False if none was open."""
        with self._cond:
            forward, self._current = self._current, None
            if forward is None:
                return False
            forward.finish(fence)
            self._cond.notify_all()
            return True

    def cursor(self, transfer_id: str) -> LayerCursor | None:
        """A write's cursor over the forward of `transfer_id`, or None when this board has none for it."""
        with self._cond:
            forward = self._by_transfer.get(transfer_id)
            return LayerCursor(self, forward) if forward is not None else None

    def next_layers(self, cursor: LayerCursor, timeout_s: float) -> list[tuple[int, Any]]:
        """The layers `cursor` may write now, waiting up to `timeout_s` for one to be ready; [] once it has taken
        every layer. TransferError when none comes in time or the board closes."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if cursor.finished:
                    return []
                if self._closed:
                    raise TransferError("the prefill side is shutting down")
                batch = cursor.take()
                if batch:
                    return batch
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"P's forward computed no further layer within {timeout_s:g} s "
                                        f"({len(cursor.taken)} of {cursor.forward.count} written)")
                self._cond.wait(left)

    def drop(self, transfer_id: str) -> None:
        """Forget `transfer_id`'s forward (its blocks are freed, or its request ended without KV)."""
        with self._cond:
            self._by_transfer.pop(transfer_id, None)

    def remembered(self) -> int:
        """How many transfers' forwards the board remembers."""
        with self._cond:
            return len(self._by_transfer)

    def close(self) -> None:
        """Every write waiting for a layer fails now; later ones fail at once."""
        with self._cond:
            self._closed = True
            self._by_transfer.clear()
            self._cond.notify_all()

"""Which KV blocks each engine holds, in the proxy's key space (pure: no sockets, clock passed in).

Per engine, two views:
- reported: what the engine's KV events say it stores (BlockStored adds,
  BlockRemoved drops, AllBlocksCleared empties), keyed by pdkv.proxy.kv.prefix
  keys chained over the events' token ids;
- predicted: blocks the proxy has just routed there and whose events have
  not come yet (a request racing ahead of them), each expiring after
  `predict_ttl_s`.

An engine whose stream is silent or broken (`mark_approximate`) is routed
by what the proxy itself sent there alone, each entry expiring after
`approximate_ttl_s`; its reported view is not trusted until the stream is
rebuilt (`reset` before a replay from the start).

`KvIndex` is shared by the event thread (writes) and the proxy's loop
(reads and predictions): every method takes `_lock` (guarded by _lock:
`_views`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import msgspec

from pdkv.proxy.kv.events import PRIMARY_MEDIUMS, AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event, extra_of
from pdkv.proxy.kv.prefix import ROOT_KEY, BlockKey, chain_key

MAX_PREDICTED = 200_000  # per engine: a sweep of expired entries runs past this


class Hits(msgspec.Struct, frozen=True):
    """The leading blocks of a request an engine holds: `reported` by its events, `predicted` on top."""

    reported: int = 0
    predicted: int = 0

    @property
    def blocks(self) -> int:
        return self.reported + self.predicted


class ApplyResult(msgspec.Struct):
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0  # stored blocks whose parent the index never saw (events missed): not keyable
    ignored: int = 0  # offload tiers, other KV cache groups


class _View:
    __slots__ = ("approximate", "awaiting_since", "block_size", "by_hash", "held", "predicted")

    def __init__(self) -> None:
        self.by_hash: dict[EngineHash, BlockKey] = {}
        self.held: dict[BlockKey, int] = {}  # key -> how many engine hashes name it
        self.predicted: dict[BlockKey, float] = {}  # key -> expiry (clock seconds)
        self.approximate = False
        self.block_size: int | None = None
        # When the oldest routed-but-unconfirmed prediction was made (None: nothing awaited): the silence test.
        self.awaiting_since: float | None = None


class KvIndex:
    """Per-engine cached blocks by the proxy's keys. Engines are named by any string (their URL)."""

    def __init__(self, *, predict_ttl_s: float = 10.0, approximate_ttl_s: float = 120.0) -> None:
        self.predict_ttl_s = predict_ttl_s
        self.approximate_ttl_s = approximate_ttl_s
        self._lock = threading.Lock()
        self._views: dict[str, _View] = {}

    def _view(self, engine: str) -> _View:
        view = self._views.get(engine)
        if view is None:
            view = self._views[engine] = _View()
        return view

    # --- the event thread
    def apply(self, engine: str, events: Iterable[Event], now: float) -> ApplyResult:
        """Apply one batch of `engine`'s events in order."""
        result = ApplyResult()
        with self._lock:
            view = self._view(engine)
            for event in events:
                if isinstance(event, BlockStored):
                    self._stored(view, event, result)
                elif isinstance(event, BlockRemoved):
                    self._removed(view, event, result)
                elif isinstance(event, AllBlocksCleared):
                    view.by_hash.clear()
                    view.held.clear()
                    view.predicted.clear()
                    result.cleared += 1
            if result.stored or result.cleared:
                view.awaiting_since = None
        return result

    @staticmethod
    def _stored(view: _View, event: BlockStored, result: ApplyResult) -> None:
        n = len(event.block_hashes)
        if event.medium not in PRIMARY_MEDIUMS or event.group_idx not in (None, 0):
            result.ignored += n
            return
        size = event.block_size
        if n == 0 or len(event.token_ids) != n * size:
            result.orphans += n
            return
        if event.parent_block_hash is None:
            parent = ROOT_KEY
        else:
            found = view.by_hash.get(event.parent_block_hash)
            if found is None:
                result.orphans += n
                return
            parent = found
        view.block_size = size
        for i, engine_hash in enumerate(event.block_hashes):
            parent = chain_key(parent, event.token_ids[i * size : (i + 1) * size], extra_of(event, i))
            previous = view.by_hash.get(engine_hash)
            if previous == parent:
                continue  # re-stored (a prefix-cache reuse report): already counted
            if previous is not None:
                _drop(view, previous)
            view.by_hash[engine_hash] = parent
            view.held[parent] = view.held.get(parent, 0) + 1
            view.predicted.pop(parent, None)
            result.stored += 1

    @staticmethod
    def _removed(view: _View, event: BlockRemoved, result: ApplyResult) -> None:
        if event.medium not in PRIMARY_MEDIUMS or event.group_idx not in (None, 0):
            result.ignored += len(event.block_hashes)
            return
        for engine_hash in event.block_hashes:
            key = view.by_hash.pop(engine_hash, None)
            if key is not None:
                _drop(view, key)
                result.removed += 1

    def reset(self, engine: str) -> None:
        """Forget what `engine` reported (a new stream: restarted engine, or a replay from the start follows)."""
        with self._lock:
            view = self._view(engine)
            view.by_hash.clear()
            view.held.clear()

    def forget(self, engine: str) -> None:
        with self._lock:
            self._views.pop(engine, None)

    def mark_approximate(self, engine: str, approximate: bool) -> bool:
        """Route `engine` by predictions alone (True) or by its events again (False); returns whether it changed."""
        with self._lock:
            view = self._view(engine)
            changed = view.approximate != approximate
            view.approximate = approximate
            view.awaiting_since = None
            return changed

    # --- the request path
    def hits(self, engine: str, keys: Sequence[BlockKey], now: float) -> Hits:
        """How many leading `keys` `engine` holds (reported, then predicted and unexpired)."""
        reported = predicted = 0
        with self._lock:
            view = self._views.get(engine)
            if view is None:
                return Hits()
            held = {} if view.approximate else view.held
            for key in keys:
                if key in held:
                    if predicted:  # a reported block after a predicted one: the chain is partly predicted
                        predicted += 1
                    else:
                        reported += 1
                    continue
                expiry = view.predicted.get(key)
                if expiry is None or expiry < now:
                    break
                predicted += 1
        return Hits(reported, predicted)

    def predict(self, engine: str, keys: Sequence[BlockKey], now: float) -> int:
        """Note that `engine` is about to compute `keys` (the request was routed there); returns how many were new."""
        with self._lock:
            view = self._view(engine)
            ttl = self.approximate_ttl_s if view.approximate else self.predict_ttl_s
            new = 0
            for key in keys:
                if key not in view.held or view.approximate:
                    if key not in view.predicted:
                        new += 1
                    view.predicted[key] = now + ttl
            if new and not view.approximate and view.awaiting_since is None:
                view.awaiting_since = now
            if len(view.predicted) > MAX_PREDICTED:
                view.predicted = {k: e for k, e in view.predicted.items() if e >= now}
            return new

    def silent_since(self, engine: str) -> float | None:
        """Since when `engine` owes events for blocks routed to it (None: it owes none)."""
        with self._lock:
            view = self._views.get(engine)
            return None if view is None else view.awaiting_since

    def block_size(self, engine: str) -> int | None:
        with self._lock:
            view = self._views.get(engine)
            return None if view is None else view.block_size

    def sizes(self) -> dict[str, tuple[int, int, bool]]:
        """engine -> (reported blocks, predicted entries, approximate)."""
        with self._lock:
            return {e: (len(v.held), len(v.predicted), v.approximate) for e, v in self._views.items()}


def _drop(view: _View, key: BlockKey) -> None:
    count = view.held.get(key, 0) - 1
    if count > 0:
        view.held[key] = count
    else:
        view.held.pop(key, None)

"""P's write threads, one small pool per D, so that a stalled D holds up only its own transfers."""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

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

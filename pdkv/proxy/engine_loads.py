"""The proxy's one reader of its engines' own `/metrics`: what each engine says of its load.

One client (`pdkv.engine_api.AsyncEngineClient` over the backend's own pool) and one table of readings,
fed by a loop over every live engine when the kv-aware policy wants them every `interval_s` (D's load and
KV usage enter its cost), and read by the planner for P's queue: a planner round takes each prefill server's
reading when it is younger than its bound, and scrapes only the servers whose reading is older (or when the
loop does not run). Readings are owned by the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from pdkv.engine_api import AsyncEngineClient, EngineLoad
from pdkv.errors import RemoteError, UnreachableError
from pdkv.proxy.backends import Backends, BackendState
from pdkv.proxy.http import PoolTransport

log = logging.getLogger("pdkv.proxy")

# (engine url, the previous reading or None, the new one): called for each new reading
Observer = Callable[[str, EngineLoad | None, EngineLoad], None]


class EngineLoads:
    """Each engine's last reading, when it was taken (monotonic), and the scrape that makes them."""

    def __init__(self, backends: Backends, timeout_s: float = 2.0) -> None:
        self.backends = backends
        self.timeout_s = timeout_s
        self.readings: dict[str, tuple[EngineLoad, float]] = {}  # engine url -> (reading, when)
        self.observers: list[Observer] = []
        self.on_error: list[Callable[[str], None]] = []  # engine url: a scrape that got no reading

    def reading(self, url: str, now: float, max_age_s: float) -> EngineLoad | None:
        """The engine's last reading if it is at most `max_age_s` old."""
        seen = self.readings.get(url)
        if seen is None or now - seen[1] > max_age_s:
            return None
        return seen[0]

    async def scrape(self, states: Iterable[BackendState]) -> None:
        """Read every engine in `states` now, at once; one that does not answer keeps its old reading."""
        await asyncio.gather(*(self._scrape(b) for b in states))

    async def _scrape(self, b: BackendState) -> None:
        try:
            load: EngineLoad | None = await AsyncEngineClient(b.url, timeout=self.timeout_s, transport=PoolTransport(b.pool)).load()
        except (UnreachableError, RemoteError) as exc:
            log.debug("/metrics of %s: %s", b.url, exc)
            load = None
        if load is None:
            for note in self.on_error:
                note(b.url)
            return
        before = self.readings.get(b.url)
        self.readings[b.url] = (load, time.monotonic())
        for observe in self.observers:
            observe(b.url, before[0] if before else None, load)

    async def fresh(self, states: Iterable[BackendState], max_age_s: float) -> list[EngineLoad | None]:
        """A reading per state no older than `max_age_s`, scraping only those whose last one is older."""
        states = list(states)
        now = time.monotonic()
        await self.scrape([b for b in states if self.reading(b.url, now, max_age_s) is None])
        now = time.monotonic()
        # a server that did not answer now keeps no reading older than the bound and the scrape's own wait
        return [self.reading(b.url, now, max_age_s + self.timeout_s) for b in states]

    async def run(self, interval_s: float) -> None:
        """Read every live engine every `interval_s` until cancelled."""
        while True:
            await self.scrape([b for b in (*self.backends.prefills, *self.backends.decodes) if b.up])
            await asyncio.sleep(interval_s)

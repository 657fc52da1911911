"""Keeping the routing view (pdkv.proxy.backends) current: health rounds, liveness probes, members registries.

A prefill server is routable when its /health answers 200 and its bootstrap
/query names at least one engine; each DP rank becomes one PrefillTarget. The
engine ids are re-read on every health round (a restarted P registers a new
one) and dropped at once when the query fails, so D is never told to pull
from an engine that is gone. A decode server is routable when /health answers.

A backend is taken out after `unhealthy_after` failed rounds in a row, at
once when a request cannot connect to it, or when `probe_failures` liveness
probes in a row (a TCP connect every `probe_interval`, cheap enough to run
often) fail: then the requests in flight on it end at once with a clear error
instead of waiting on a host that is gone. It is put back by the first round
that passes.

With `members` URLs the proxy follows those bootstrap servers' members
registries (pdkv.bootstrap.members): a server that joins is health-checked at
once and routed to when it passes; one that leaves, or whose lease expires,
gets no new requests (those in flight finish). Backends given on the command
line stay whatever the registry says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from pdkv.engine_api import AsyncEngineClient
from pdkv.errors import PdkvError
from pdkv.proxy.backends import Backends, BackendState, PrefillState
from pdkv.proxy.http import PoolTransport, UpstreamError, connect_bounded
from pdkv.proxy.membership import Membership, group

log = logging.getLogger("pdkv.proxy")


class Health:
    """The loops that decide what `backends` routes to: `run()` until cancelled, or one step at a time."""

    def __init__(self, backends: Backends) -> None:
        self.backends = backends
        self.config = backends.config
        self._clients: dict[str, Any] = {}  # bootstrap URL -> its AsyncBootstrapClient
        self._noted: set[str] = set()  # warnings logged once
        self.membership_version: tuple[int, ...] = ()
        # Engine URL -> (KV events publisher, replay) from the registry, and who follows them (the kv-aware policy).
        self.events: dict[str, tuple[str, str | None]] = {}
        self.on_events: Callable[[str, str | None, str | None], None] | None = None
        self.rounds = 0  # health rounds done

    def _client(self, url: str) -> Any:
        client = self._clients.get(url)
        if client is None:
            from pdkv.bootstrap import AsyncBootstrapClient  # httpx: only once a bootstrap is asked

            client = self._clients[url] = AsyncBootstrapClient(url, timeout=self.config.health_timeout, retries=0)
        return client

    # --- health rounds
    async def check_once(self) -> None:
        """One health round over every backend, concurrently, then the routing view is rebuilt."""
        b = self.backends
        if self.config.members:
            await self.refresh_members()
        await asyncio.gather(*(self._check_prefill(p) for p in b.prefills), *(self._check_decode(d) for d in b.decodes))
        b.rebuild()
        b.close_retired()
        self.rounds += 1

    async def _health(self, state: BackendState) -> str | None:
        engine = AsyncEngineClient(state.url, timeout=self.config.health_timeout, transport=PoolTransport(state.pool))
        return await engine.health_problem()

    async def _check_prefill(self, p: PrefillState) -> None:
        reason = await self._health(p)
        if reason is not None:
            self.backends.mark(p, False, reason)
            return
        try:
            entries = await self._client(p.bootstrap_url).query()
        except PdkvError as exc:
            # Never keep engine ids we could not confirm: a restarted P has new ones.
            p.engines = {}
            self.backends.mark(p, False, f"bootstrap {p.bootstrap_url}/query: {exc.message}", immediate=True)
            return
        engines = {rank: entry.engine_id for rank, entry in entries.items()}
        if not engines:
            p.engines = {}
            self.backends.mark(p, False, f"bootstrap {p.bootstrap_url} has no engine registered yet", immediate=True)
            return
        if engines != p.engines and p.engines:
            log.info("prefill %s engine ids changed: %s -> %s", p.url, p.engines, engines)
        p.engines = engines
        p.workers = {rank: [a for tp in entry.worker_addr.values() for a in tp.values()] for rank, entry in entries.items()}
        self.backends.mark(p, True, "ok")

    async def _check_decode(self, d: BackendState) -> None:
        reason = await self._health(d)
        self.backends.mark(d, reason is None, reason or "ok")

    # --- liveness
    async def probe_once(self) -> None:
        """One TCP connect to every backend that is up; `probe_failures` failures in a row take it out and
        end its requests in flight."""
        b_all = self.backends
        live = [b for b in (*b_all.prefills, *b_all.decodes) if b.up]
        results = await asyncio.gather(*(self._reachable(b) for b in live))
        changed = False
        for b, reason in zip(live, results, strict=True):
            if reason is None:
                b.probe_failures = 0
                continue
            b.probe_failures += 1
            if b.probe_failures >= self.config.probe_failures and b.up:
                why = f"unreachable: {reason} ({b.probe_failures} probes in a row)"
                b_all.mark(b, False, why, immediate=True)
                n = b.pool.fail_all(UpstreamError("unreachable", f"{b.role} {b.url} {why}"))
                log.warning("%s %s %s; %d request(s) in flight on it ended", b.role, b.url, why, n)
                changed = True
        if changed:
            b_all.rebuild()
            b_all.wake.set()

    async def _reachable(self, b: BackendState) -> str | None:
        try:
            transport, _ = await connect_bounded(asyncio.Protocol, b.pool.host, b.pool.port, self.config.probe_interval)
        except asyncio.TimeoutError:
            return f"no TCP connection within {self.config.probe_interval:g} s"
        except OSError as exc:
            return f"TCP connect failed: {exc.strerror or exc}"
        transport.close()
        return None

    # --- members registries
    def apply_membership(self, view: Membership) -> bool:
        """Make the registry's view the routing view's: add servers that joined, retire the registry's own
        ones that left, attach compatibility keys. True if a server was added (health-check it now)."""
        backends = self.backends
        added = False
        seen_p, seen_d = set(view.prefills), set(view.decodes)
        for p in backends.prefills:
            member = view.prefills.get(p.url)
            p.key = member.key if member is not None else (p.key if not p.static else None)
        for d in backends.decodes:
            d.key = view.decodes.get(d.url, d.key if not d.static else None)
        have_p = {p.url for p in backends.prefills}
        for url, member in view.prefills.items():
            if url not in have_p:
                backends.add_prefill(url, member.bootstrap_url, member.key)
                log.info("prefill %s joined (engines %s, bootstrap %s)", url, member.engines, member.bootstrap_url)
                added = True
        have_d = {d.url for d in backends.decodes}
        for url, key in view.decodes.items():
            if url not in have_d:
                backends.add_decode(url, key)
                log.info("decode %s joined", url)
                added = True
        gone = [b for b in (*backends.prefills, *backends.decodes)
                if not b.static and b.url not in (seen_p if b.role == "prefill" else seen_d)]
        for b in gone:
            log.info("%s %s left the registry: no new requests", b.role, b.url)
        if gone:
            backends.retire(gone)
        for conflict in view.conflicts:
            if conflict not in self._noted:
                self._noted.add(conflict)
                log.warning("members registry: %s", conflict)
        backends.conflicts = list(view.conflicts)
        if self.on_events is not None:  # the kv-aware policy follows each engine's KV events
            for url in sorted(set(self.events) | set(view.events)):
                if self.events.get(url) != view.events.get(url):
                    pub, replay = view.events.get(url, (None, None))
                    self.on_events(url, pub, replay)
        self.events = dict(view.events)
        backends.rebuild()
        return added

    async def refresh_members(self) -> bool:
        """Read every members registry once; True if a server joined. A registry that does not answer keeps
        the last view (the proxy's own health checks still take out what is down)."""
        records, versions = [], []
        for url in self.config.members:
            try:
                answer = await self._client(url).members()
            except PdkvError as exc:
                if f"members:{url}" not in self._noted:
                    self._noted.add(f"members:{url}")
                    log.warning("members registry %s: %s; keeping the last view", url, exc.message)
                return False
            self._noted.discard(f"members:{url}")
            records += [m.record for m in answer.members]
            versions.append(answer.version)
        if tuple(versions) == self.membership_version:
            return False
        self.membership_version = tuple(versions)
        return self.apply_membership(group(records))

    # --- loops
    async def run(self) -> None:
        """Health rounds every `health_interval` seconds (sooner after a connect failure or a join), the members
        registry every `members_interval`, liveness probes every `probe_interval`; until cancelled."""
        await asyncio.gather(self._health_loop(), self._members_loop(), self._probe_loop())

    async def _health_loop(self) -> None:
        wake = self.backends.wake
        while True:
            try:
                await self.check_once()
            except Exception:  # a bug in one round must not stop health checking
                log.exception("health round failed")
            wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), self.config.health_interval)

    async def _members_loop(self) -> None:
        if not self.config.members:
            return
        while True:
            await asyncio.sleep(self.config.members_interval)
            try:
                if await self.refresh_members():
                    self.backends.wake.set()
            except Exception:  # noqa: BLE001 - the next read tries again
                log.exception("members refresh failed")

    async def _probe_loop(self) -> None:
        if self.config.probe_interval <= 0:
            return
        while True:
            await asyncio.sleep(self.config.probe_interval)
            try:
                await self.probe_once()
            except Exception:  # noqa: BLE001
                log.exception("liveness probe round failed")

    async def close(self) -> None:
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()

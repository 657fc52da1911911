"""Which backends are up, their prefill engine ids, and the health loop that keeps both current.

A prefill server is routable when its /health answers 200 and its bootstrap
/query names at least one engine; each DP rank becomes one PrefillTarget. The
engine ids are re-read on every health round (a restarted P registers a new
one) and dropped at once when the query fails, so D is never told to pull
from an engine that is gone. A decode server is routable when /health answers.

A backend is taken out after `unhealthy_after` failed rounds in a row, or at
once when a request cannot connect to it; it is put back by the first round
that passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pdkv.errors import PdkvError
from pdkv.proxy.http import UpstreamError, UpstreamPool, fetch
from pdkv.proxy.routing import Chooser, Pairing, PrefillTarget, ProxyConfig, choose_pair

log = logging.getLogger("pdkv.proxy")


class BackendState:
    __slots__ = ("role", "url", "pool", "up", "failures", "reason", "outstanding")

    def __init__(self, role: str, url: str, pool: UpstreamPool) -> None:
        self.role = role
        self.url = url
        self.pool = pool
        self.up = False
        self.failures = 0
        self.reason = "not checked yet"
        self.outstanding = 0


class PrefillState(BackendState):
    __slots__ = ("bootstrap_url", "engines", "workers")

    def __init__(self, url: str, bootstrap_url: str, pool: UpstreamPool) -> None:
        super().__init__("prefill", url, pool)
        self.bootstrap_url = bootstrap_url
        self.engines: dict[int, str] = {}
        self.workers: dict[int, list[str]] = {}  # DP rank -> its workers' side channels (from the bootstrap)


class Backends:
    """The live view the request path routes by; `run_health()` keeps it current."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        pool = lambda url: UpstreamPool(url, connect_timeout=config.connect_timeout)  # noqa: E731
        self.prefills = [PrefillState(p.url, p.bootstrap_url, pool(p.url)) for p in config.prefill]
        self.decodes = [BackendState("decode", d, pool(d)) for d in config.decode]
        self._p_chooser = Chooser(config.policy)
        self._d_chooser = Chooser(config.policy)
        self._targets: list[PrefillTarget] = []
        self._target_owner: list[PrefillState] = []
        self._target_load: dict[tuple[str, int], int] = {}
        self._live_decodes: list[BackendState] = []
        self._wake = asyncio.Event()
        self._clients: dict[str, object] = {}
        self.rounds = 0

    # --- request path
    def pair(self) -> tuple[Pairing, PrefillState, BackendState] | None:
        """A prefill engine and a decode server to send one request to, or None if no pair is up."""
        targets, decodes = self._targets, self._live_decodes
        if not targets or not decodes:
            return None
        load = self._target_load
        chosen = choose_pair(
            [load.get((t.url, t.dp_rank), 0) for t in targets],
            [d.outstanding for d in decodes],
            self._p_chooser,
            self._d_chooser,
        )
        assert chosen is not None
        p_index, d_index = chosen
        d_state = decodes[d_index]
        return Pairing(targets[p_index], d_state.url), self._target_owner[p_index], d_state

    def routable(self) -> tuple[list[PrefillTarget], list[PrefillState], list[BackendState]]:
        """The prefill engines (with each one's owning server) and decode servers up now, for a policy
        that chooses by more than load (kv-aware); pair its choice with `Pairing(targets[i], decode.url)`."""
        return self._targets, self._target_owner, self._live_decodes

    def begin(self, pairing: Pairing, d_state: BackendState) -> None:
        key = (pairing.prefill.url, pairing.prefill.dp_rank)
        self._target_load[key] = self._target_load.get(key, 0) + 1
        d_state.outstanding += 1

    def end(self, pairing: Pairing, p_state: PrefillState, d_state: BackendState) -> None:
        key = (pairing.prefill.url, pairing.prefill.dp_rank)
        self._target_load[key] -= 1
        p_state.outstanding = sum(n for (u, _), n in self._target_load.items() if u == p_state.url)
        d_state.outstanding -= 1

    def connect_failed(self, state: BackendState, reason: str) -> None:
        """A request could not connect: take the backend out now and check it again soon."""
        self._mark(state, False, reason, immediate=True)
        self._rebuild()
        self._wake.set()

    def readiness(self) -> tuple[bool, str]:
        if not self._targets:
            detail = "; ".join(f"{p.url}: {p.reason}" for p in self.prefills)
            return False, f"no prefill server is ready ({detail})"
        if not self._live_decodes:
            detail = "; ".join(f"{d.url}: {d.reason}" for d in self.decodes)
            return False, f"no decode server is ready ({detail})"
        return True, "ok"

    def rows(self) -> list[tuple[str, str, bool, int]]:
        return [(b.role, b.url, b.up, b.outstanding) for b in (*self.prefills, *self.decodes)]

    def live_decode(self) -> BackendState | None:
        """A decode server for a request D computes alone (by the decode policy), or None if none is up."""
        decodes = self._live_decodes
        if not decodes:
            return None
        return decodes[self._d_chooser.choose([d.outstanding for d in decodes])]

    def any_decode(self) -> BackendState:
        return self._live_decodes[0] if self._live_decodes else self.decodes[0]

    # --- health
    def _mark(self, state: BackendState, ok: bool, reason: str, *, immediate: bool = False) -> None:
        if ok:
            if not state.up:
                log.info("%s %s is up", state.role, state.url)
            state.up, state.failures, state.reason = True, 0, "ok"
            return
        state.failures += 1
        state.reason = reason
        if state.up and (immediate or state.failures >= self.config.unhealthy_after):
            log.warning("%s %s taken out: %s", state.role, state.url, reason)
            state.up = False
        if isinstance(state, PrefillState) and not state.up:
            state.engines = {}

    def _rebuild(self) -> None:
        targets, owners = [], []
        for p in self.prefills:
            if not p.up:
                continue
            size = len(p.engines)
            for rank in sorted(p.engines):
                targets.append(PrefillTarget(p.url, p.bootstrap_url, rank, size, p.engines[rank]))
                owners.append(p)
        self._targets, self._target_owner = targets, owners
        self._live_decodes = [d for d in self.decodes if d.up]

    async def _health(self, state: BackendState) -> str | None:
        try:
            ex = await fetch(state.pool, "GET", "/health", timeout=self.config.health_timeout)
        except UpstreamError as exc:
            return f"/health: {exc}"
        return None if 200 <= ex.status < 300 else f"/health answered {ex.status}"

    async def _check_prefill(self, p: PrefillState) -> None:
        from pdkv.bootstrap.client import AsyncBootstrapClient

        reason = await self._health(p)
        if reason is not None:
            self._mark(p, False, reason)
            return
        client = self._clients.get(p.bootstrap_url)
        if client is None:
            client = self._clients[p.bootstrap_url] = AsyncBootstrapClient(
                p.bootstrap_url, timeout=self.config.health_timeout, retries=0
            )
        try:
            entries = await client.query()  # type: ignore[attr-defined]
        except PdkvError as exc:
            # Never keep engine ids we could not confirm: a restarted P has new ones.
            p.engines = {}
            self._mark(p, False, f"bootstrap {p.bootstrap_url}/query: {exc.message}", immediate=True)
            return
        engines = {rank: entry.engine_id for rank, entry in entries.items()}
        if not engines:
            p.engines = {}
            self._mark(p, False, f"bootstrap {p.bootstrap_url} has no engine registered yet", immediate=True)
            return
        if engines != p.engines and p.engines:
            log.info("prefill %s engine ids changed: %s -> %s", p.url, p.engines, engines)
        p.engines = engines
        p.workers = {rank: [a for tp in entry.worker_addr.values() for a in tp.values()] for rank, entry in entries.items()}
        self._mark(p, True, "ok")

    async def _check_decode(self, d: BackendState) -> None:
        reason = await self._health(d)
        self._mark(d, reason is None, reason or "ok")

    async def check_once(self) -> None:
        """One health round over every backend, concurrently, then the routing view is rebuilt."""
        await asyncio.gather(*(self._check_prefill(p) for p in self.prefills), *(self._check_decode(d) for d in self.decodes))
        self._rebuild()
        self.rounds += 1

    async def run_health(self) -> None:
        """Health rounds every `health_interval` seconds (sooner after a connect failure), until cancelled."""
        while True:
            try:
                await self.check_once()
            except Exception:  # a bug in one round must not stop health checking
                log.exception("health round failed")
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.health_interval)

    async def close(self) -> None:
        for b in (*self.prefills, *self.decodes):
            b.pool.close()
        # Aborted transports close their sockets in a callback: let it run before the loop ends.
        for _ in range(3):
            await asyncio.sleep(0)
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()  # type: ignore[attr-defined]
        self._clients.clear()

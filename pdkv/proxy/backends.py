"""Which backends are up, their prefill engine ids, and the health loop that keeps both current.

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
line stay whatever the registry says. A P and a D are paired only when their
compatibility keys agree (pdkv.proxy.membership).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from pdkv.errors import PdkvError
from pdkv.proxy.http import UpstreamError, UpstreamPool, connect_bounded, fetch
from pdkv.proxy.membership import CompatKey, Membership, compatible, unmatched
from pdkv.proxy.routing import Chooser, Pairing, PrefillTarget, ProxyConfig

log = logging.getLogger("pdkv.proxy")


class BackendState:
    __slots__ = ("role", "url", "pool", "up", "failures", "reason", "outstanding", "static", "key", "probe_failures")

    def __init__(self, role: str, url: str, pool: UpstreamPool, *, static: bool = True) -> None:
        self.role = role
        self.url = url
        self.pool = pool
        self.up = False
        self.failures = 0
        self.reason = "not checked yet"
        self.outstanding = 0
        self.static = static  # from the command line: stays whatever the registry says
        self.key: CompatKey | None = None  # from its member record, if it has one
        self.probe_failures = 0


class PrefillState(BackendState):
    __slots__ = ("bootstrap_url", "engines", "workers")

    def __init__(self, url: str, bootstrap_url: str, pool: UpstreamPool, *, static: bool = True) -> None:
        super().__init__("prefill", url, pool, static=static)
        self.bootstrap_url = bootstrap_url
        self.engines: dict[int, str] = {}
        self.workers: dict[int, list[str]] = {}  # DP rank -> its workers' side channels (from the bootstrap)


class Backends:
    """The live view the request path routes by; `run_health()` keeps it current."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefills = [PrefillState(p.url, p.bootstrap_url, self._pool(p.url)) for p in config.prefill]
        self.decodes = [BackendState("decode", d, self._pool(d)) for d in config.decode]
        self._p_chooser = Chooser(config.policy)
        self._d_chooser = Chooser(config.policy)
        self._targets: list[PrefillTarget] = []
        self._target_owner: list[PrefillState] = []
        self._target_decodes: list[list[int]] = []  # per target: indices of the live decodes it may pair with
        self._target_load: dict[tuple[str, int], int] = {}
        self._live_decodes: list[BackendState] = []
        self._retired: list[BackendState] = []  # left the registry; closed once idle
        self._wake = asyncio.Event()
        self._clients: dict[str, object] = {}
        self.notes: list[str] = []  # pairing mismatches and registry conflicts, as /health shows them
        self._noted: set[str] = set()
        self.membership_version: tuple[int, ...] = ()
        self._conflicts: list[str] = []
        # Engine URL -> (KV events publisher, replay) from the registry, and who follows them (the kv-aware policy).
        self.events: dict[str, tuple[str, str | None]] = {}
        self.on_events: Callable[[str, str | None, str | None], None] | None = None
        self.rounds = 0

    def _pool(self, url: str) -> UpstreamPool:
        return UpstreamPool(url, connect_timeout=self.config.connect_timeout)

    # --- request path
    def pair(self) -> tuple[Pairing, PrefillState, BackendState] | None:
        """A prefill engine and a decode server to send one request to, or None if no pair is up."""
        targets, decodes, pairs = self._targets, self._live_decodes, self._target_decodes
        eligible = [i for i, ds in enumerate(pairs) if ds]
        if not eligible or not decodes:
            return None
        p_index = eligible[self._p_chooser.choose([self.in_flight(targets[i]) for i in eligible])]
        candidates = pairs[p_index]
        d_state = decodes[candidates[self._d_chooser.choose([decodes[j].outstanding for j in candidates])]]
        return Pairing(targets[p_index], d_state.url), self._target_owner[p_index], d_state

    def routable(self) -> tuple[list[PrefillTarget], list[PrefillState], list[BackendState]]:
        """The prefill engines (with each one's owning server) and decode servers up now, for a policy
        that chooses by more than load (kv-aware); pair its choice with `Pairing(targets[i], decode.url)`."""
        return self._targets, self._target_owner, self._live_decodes

    def in_flight(self, target: PrefillTarget) -> int:
        """Requests this proxy has in flight through prefill engine `target` (least-outstanding's count)."""
        return self._target_load.get((target.url, target.dp_rank), 0)

    def may_pair(self, target: int, d_state: BackendState) -> bool:
        """Whether routable target `target` and decode server `d_state` agree (pdkv.proxy.membership)."""
        return compatible(self._target_owner[target].key, d_state.key)

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
        if self._targets and self._live_decodes and not any(self._target_decodes):
            return False, "no prefill engine that is up may be paired with a decode server that is up: " + "; ".join(self.notes)
        if not self._targets:
            detail = "; ".join(f"{p.url}: {p.reason}" for p in self.prefills) or "none known yet"
            return False, f"no prefill server is ready ({detail})"
        if not self._live_decodes:
            detail = "; ".join(f"{d.url}: {d.reason}" for d in self.decodes) or "none known yet"
            return False, f"no decode server is ready ({detail})"
        return True, "ok"

    def report(self) -> list[dict[str, Any]]:
        """Every backend as /health lists it."""
        out: list[dict[str, Any]] = []
        for p in self.prefills:
            out.append({"role": "prefill", "url": p.url, "up": p.up, "reason": p.reason, "bootstrap": p.bootstrap_url,
                        "engines": {str(k): v for k, v in p.engines.items()}})
        for d in self.decodes:
            out.append({"role": "decode", "url": d.url, "up": d.up, "reason": d.reason})
        return out

    def rows(self) -> list[tuple[str, str, bool, int]]:
        return [(b.role, b.url, b.up, b.outstanding) for b in (*self.prefills, *self.decodes)]

    def live_decode(self) -> BackendState | None:
        """A decode server for a request D computes alone (by the decode policy), or None if none is up."""
        decodes = self._live_decodes
        if not decodes:
            return None
        return decodes[self._d_chooser.choose([d.outstanding for d in decodes])]

    def any_decode(self) -> BackendState | None:
        return self._live_decodes[0] if self._live_decodes else (self.decodes[0] if self.decodes else None)

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
        self._live_decodes = live = [d for d in self.decodes if d.up]
        self._target_decodes = [[j for j, d in enumerate(live) if compatible(p.key, d.key)] for p in owners]
        notes = unmatched({p.url: p.key for p in self.prefills}, {d.url: d.key for d in self.decodes})
        for note in notes:
            if note not in self._noted:
                self._noted.add(note)
                log.warning("%s: it gets no requests", note)
        self.notes = notes + self._conflicts

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

    # --- membership (pdkv.proxy.follow)
    def apply_membership(self, view: Membership) -> bool:
        from pdkv.proxy.follow import apply_membership

        return apply_membership(self, view)

    async def refresh_members(self) -> bool:
        from pdkv.proxy.follow import refresh_members

        return await refresh_members(self)

    # --- liveness
    async def probe_once(self) -> None:
        """One TCP connect to every backend that is up; `probe_failures` failures in a row take it out and
        end its requests in flight."""
        live = [b for b in (*self.prefills, *self.decodes) if b.up]
        results = await asyncio.gather(*(self._reachable(b) for b in live))
        changed = False
        for b, reason in zip(live, results, strict=True):
            if reason is None:
                b.probe_failures = 0
                continue
            b.probe_failures += 1
            if b.probe_failures >= self.config.probe_failures and b.up:
                why = f"unreachable: {reason} ({b.probe_failures} probes in a row)"
                self._mark(b, False, why, immediate=True)
                n = b.pool.fail_all(UpstreamError("unreachable", f"{b.role} {b.url} {why}"))
                log.warning("%s %s %s; %d request(s) in flight on it ended", b.role, b.url, why, n)
                changed = True
        if changed:
            self._rebuild()
            self._wake.set()

    async def _reachable(self, b: BackendState) -> str | None:
        try:
            transport, _ = await connect_bounded(asyncio.Protocol, b.pool.host, b.pool.port, self.config.probe_interval)
        except asyncio.TimeoutError:
            return f"no TCP connection within {self.config.probe_interval:g} s"
        except OSError as exc:
            return f"TCP connect failed: {exc.strerror or exc}"
        transport.close()
        return None

    # --- loops
    async def check_once(self) -> None:
        """One health round over every backend, concurrently, then the routing view is rebuilt."""
        if self.config.members:
            await self.refresh_members()
        await asyncio.gather(*(self._check_prefill(p) for p in self.prefills), *(self._check_decode(d) for d in self.decodes))
        self._rebuild()
        self._close_retired()
        self.rounds += 1

    def _close_retired(self) -> None:
        keep = []
        for b in self._retired:
            busy = b.outstanding if b.role == "decode" else sum(n for (u, _), n in self._target_load.items() if u == b.url)
            if busy:
                keep.append(b)
            else:
                b.pool.close()
        self._retired = keep

    async def run_health(self) -> None:
        """Health rounds every `health_interval` seconds (sooner after a connect failure or a join), the members
        registry every `members_interval`, liveness probes every `probe_interval`; until cancelled."""
        await asyncio.gather(self._health_loop(), self._members_loop(), self._probe_loop())

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # a bug in one round must not stop health checking
                log.exception("health round failed")
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.health_interval)

    async def _members_loop(self) -> None:
        if not self.config.members:
            return
        while True:
            await asyncio.sleep(self.config.members_interval)
            try:
                if await self.refresh_members():
                    self._wake.set()
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
        for b in (*self.prefills, *self.decodes, *self._retired):
            b.pool.close()
        # Aborted transports close their sockets in a callback: let it run before the loop ends.
        for _ in range(3):
            await asyncio.sleep(0)
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()  # type: ignore[attr-defined]
        self._clients.clear()

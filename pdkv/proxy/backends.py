"""Which backends are up and how busy they are: the live view the request path routes by.

`Backends` holds every known prefill server (each DP rank of one becomes a
PrefillTarget once its bootstrap names an engine) and decode server, the
requests in flight on each, and the pairs that may be routed to (a P and a D
are paired only when their compatibility keys agree: pdkv.proxy.membership).
What is up is decided by pdkv.proxy.health through `mark`, `add_prefill`,
`add_decode`, `retire` and `rebuild`; the request path takes a backend out at
once through `connect_failed`. A draining backend (`drain`: an autoscaler is
about to stop it) gets no new request while its requests in flight finish.
"""

from __future__ import annotations

import asyncio
import logging

from pdkv.proxy.config import ProxyConfig
from pdkv.proxy.http import UpstreamPool
from pdkv.proxy.membership import CompatKey, compatible, unmatched
from pdkv.proxy.routing import Chooser, Pairing, PrefillTarget
from pdkv.proxy_api import BackendHealth, BackendRoute

log = logging.getLogger("pdkv.proxy")


class BackendState:
    __slots__ = ("role", "url", "pool", "up", "failures", "reason", "outstanding", "static", "key", "probe_failures", "draining")

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
        self.draining = False  # to be stopped: no new requests, whatever its health


class PrefillState(BackendState):
    __slots__ = ("bootstrap_url", "engines", "workers")

    def __init__(self, url: str, bootstrap_url: str, pool: UpstreamPool, *, static: bool = True) -> None:
        super().__init__("prefill", url, pool, static=static)
        self.bootstrap_url = bootstrap_url
        self.engines: dict[int, str] = {}
        self.workers: dict[int, list[str]] = {}  # DP rank -> its workers' side channels (from the bootstrap)


class Backends:
    """The live view the request path routes by; pdkv.proxy.health keeps it current."""

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
        # Set when a health round should run before its interval is up (a connect failure, a join).
        self.wake = asyncio.Event()
        self.notes: list[str] = []  # pairing mismatches and registry conflicts, as /health shows them
        self._noted: set[str] = set()
        self.conflicts: list[str] = []  # the members registries' conflicts (pdkv.proxy.health)

    def _pool(self, url: str) -> UpstreamPool:
        return UpstreamPool(url, connect_timeout=self.config.connect_timeout)

    # --- membership (decided by pdkv.proxy.health)
    def add_prefill(self, url: str, bootstrap_url: str, key: CompatKey | None) -> PrefillState:
        """A prefill server learnt at run time (not from the command line); not routed to before it is marked up."""
        state = PrefillState(url, bootstrap_url, self._pool(url), static=False)
        state.key = key
        self.prefills.append(state)
        return state

    def add_decode(self, url: str, key: CompatKey | None) -> BackendState:
        """A decode server learnt at run time; not routed to before it is marked up."""
        state = BackendState("decode", url, self._pool(url), static=False)
        state.key = key
        self.decodes.append(state)
        return state

    def retire(self, gone: list[BackendState]) -> None:
        """Route nothing new to `gone`; each one's pool closes once its requests in flight end (`close_retired`)."""
        for b in gone:
            b.up = False
        self._retired += gone
        self.prefills = [p for p in self.prefills if p not in gone]
        self.decodes = [d for d in self.decodes if d not in gone]

    def close_retired(self) -> None:
        keep = []
        for b in self._retired:
            if self.busy(b):
                keep.append(b)
            else:
                b.pool.close()
        self._retired = keep

    def drain(self, url: str, on: bool = True) -> BackendState | None:
        """Route no new request to the backend at `url` (or again, with `on` False); None if none is known there."""
        state = next((b for b in (*self.prefills, *self.decodes) if b.url == url), None)
        if state is not None and state.draining != on:
            state.draining = on
            log.info("%s %s %s", state.role, state.url, "drains: no new requests" if on else "takes requests again")
            self.rebuild()
        return state

    def busy(self, state: BackendState) -> int:
        """Requests this proxy has in flight on `state` (for a prefill server: through any of its engines, until D is done)."""
        if state.role == "decode":
            return state.outstanding
        return sum(n for (u, _), n in self._target_load.items() if u == state.url)

    def drain_report(self) -> list[BackendRoute]:
        """Every backend's routing state and requests in flight, as GET /pdkv/planner shows them."""
        return [BackendRoute(b.role, b.url, b.up, b.draining, self.busy(b)) for b in (*self.prefills, *self.decodes)]

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

    def begin_local(self, d_state: BackendState) -> None:
        """A request D computes alone starts (it counts toward D's outstanding, as a P/D one does)."""
        d_state.outstanding += 1

    def end_local(self, d_state: BackendState) -> None:
        d_state.outstanding -= 1

    def connect_failed(self, state: BackendState, reason: str) -> None:
        """A request could not connect: take the backend out now and check it again soon."""
        self.mark(state, False, reason, immediate=True)
        self.rebuild()
        self.wake.set()

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

    def report(self) -> list[BackendHealth]:
        """Every backend as /health lists it."""
        out = [BackendHealth("prefill", p.url, p.up, p.reason, p.bootstrap_url, {str(k): v for k, v in p.engines.items()})
               for p in self.prefills]
        out.extend(BackendHealth("decode", d.url, d.up, d.reason) for d in self.decodes)
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

    # --- health (decided by pdkv.proxy.health)
    def mark(self, state: BackendState, ok: bool, reason: str, *, immediate: bool = False) -> None:
        """One check's outcome: up at once when `ok`; out after `unhealthy_after` failures in a row, or at once."""
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

    def rebuild(self) -> None:
        """Recompute the routable targets and pairs from the backends' states; call it after a change."""
        targets, owners = [], []
        for p in self.prefills:
            if not p.up or p.draining:
                continue
            size = len(p.engines)
            for rank in sorted(p.engines):
                targets.append(PrefillTarget(p.url, p.bootstrap_url, rank, size, p.engines[rank]))
                owners.append(p)
        self._targets, self._target_owner = targets, owners
        self._live_decodes = live = [d for d in self.decodes if d.up and not d.draining]
        self._target_decodes = [[j for j, d in enumerate(live) if compatible(p.key, d.key)] for p in owners]
        notes = unmatched({p.url: p.key for p in self.prefills}, {d.url: d.key for d in self.decodes})
        for note in notes:
            if note not in self._noted:
                self._noted.add(note)
                log.warning("%s: it gets no requests", note)
        self.notes = notes + self.conflicts

    async def close(self) -> None:
        for b in (*self.prefills, *self.decodes, *self._retired):
            b.pool.close()
        # Aborted transports close their sockets in a callback: let it run before the loop ends.
        for _ in range(3):
            await asyncio.sleep(0)

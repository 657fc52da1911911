"""The proxy following members registries (pdkv.bootstrap.members): the registry's view made the routing view's.

Functions over `Backends` (they reach its internals: one package, one view), called by its loops.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pdkv.errors import PdkvError
from pdkv.proxy.membership import Membership, group

if TYPE_CHECKING:
    from pdkv.proxy.backends import Backends

log = logging.getLogger("pdkv.proxy")


def apply_membership(backends: Backends, view: Membership) -> bool:
    """Make the registry's view the routing view's: add servers that joined, retire the registry's own
    ones that left, attach compatibility keys. True if a server was added (health-check it now)."""
    from pdkv.proxy.backends import BackendState, PrefillState

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
            state = PrefillState(url, member.bootstrap_url, backends._pool(url), static=False)
            state.key = member.key
            backends.prefills.append(state)
            log.info("prefill %s joined (engines %s, bootstrap %s)", url, member.engines, member.bootstrap_url)
            added = True
    have_d = {d.url for d in backends.decodes}
    for url, key in view.decodes.items():
        if url not in have_d:
            state = BackendState("decode", url, backends._pool(url), static=False)
            state.key = key
            backends.decodes.append(state)
            log.info("decode %s joined", url)
            added = True
    gone = [b for b in (*backends.prefills, *backends.decodes) if not b.static and b.url not in (seen_p if b.role == "prefill" else seen_d)]
    for b in gone:
        log.info("%s %s left the registry: no new requests", b.role, b.url)
        b.up = False
        backends._retired.append(b)
    if gone:
        backends.prefills = [p for p in backends.prefills if p not in gone]
        backends.decodes = [d for d in backends.decodes if d not in gone]
    for conflict in view.conflicts:
        if conflict not in backends._noted:
            backends._noted.add(conflict)
            log.warning("members registry: %s", conflict)
    backends._conflicts = list(view.conflicts)
    if backends.on_events is not None:  # the kv-aware policy follows each engine's KV events
        for url in sorted(set(backends.events) | set(view.events)):
            if backends.events.get(url) != view.events.get(url):
                pub, replay = view.events.get(url, (None, None))
                backends.on_events(url, pub, replay)
    backends.events = dict(view.events)
    backends._rebuild()
    return added

async def refresh_members(backends: Backends) -> bool:
    """Read every members registry once; True if a server joined. A registry that does not answer keeps
    the last view (the proxy's own health checks still take out what is down)."""
    from pdkv.bootstrap.client import AsyncBootstrapClient

    records, versions = [], []
    for url in backends.config.members:
        client = backends._clients.get(url)
        if client is None:
            client = backends._clients[url] = AsyncBootstrapClient(url, timeout=backends.config.health_timeout, retries=0)
        try:
            answer = await client.members()  # type: ignore[attr-defined]
        except PdkvError as exc:
            if f"members:{url}" not in backends._noted:
                backends._noted.add(f"members:{url}")
                log.warning("members registry %s: %s; keeping the last view", url, exc.message)
            return False
        backends._noted.discard(f"members:{url}")
        records += [m.record for m in answer.members]
        versions.append(answer.version)
    if tuple(versions) == backends.membership_version:
        return False
    backends.membership_version = tuple(versions)
    return backends.apply_membership(group(records))

"""What the proxy makes of a members registry's list, and which P may be paired with which D. Pure.

Each member record is one engine (one DP rank); the proxy routes to servers
(URLs), so records are grouped by URL: a prefill server's DP ranks become its
engines. A P and a D are paired only when their compatibility keys agree
(model, block size, connector, transport; TP sizes one of which divides the
other): D would otherwise pull KV it cannot use. A backend given on the command line carries no key and is paired
with anything, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from pdkv.wire import MemberRecord

CompatKey = tuple[str, int, int, str, str]


class PrefillMember(msgspec.Struct, frozen=True):
    url: str
    bootstrap_url: str
    engines: dict[int, str]  # DP rank -> engine id
    key: CompatKey


class Membership(msgspec.Struct, frozen=True):
    """The registry's view, by server URL."""

    prefills: dict[str, PrefillMember]
    decodes: dict[str, CompatKey]
    conflicts: tuple[str, ...] = ()  # records that disagree with others of the same server
    events: dict[str, tuple[str, str | None]] = {}  # server URL -> its first rank's KV events (publisher, replay)


def group(records: Iterable[MemberRecord]) -> Membership:
    """Records by server URL. A server whose ranks disagree (role, bootstrap, key) keeps its first rank's
    view; the disagreement is reported in `conflicts`."""
    prefills: dict[str, PrefillMember] = {}
    decodes: dict[str, CompatKey] = {}
    conflicts: list[str] = []
    events: dict[str, tuple[str, str | None]] = {}
    for rec in sorted(records, key=lambda r: (r.url, r.dp_rank, r.member_id)):
        key = rec.compat_key()
        if rec.kv_events is not None:
            events.setdefault(rec.url, (rec.kv_events, rec.kv_events_replay))
        if rec.role == "prefill":
            assert rec.bootstrap_url is not None  # MemberRecord refuses a prefill without one
            if rec.url in decodes:
                conflicts.append(f"{rec.member_id} registers {rec.url} as prefill, another engine as decode")
                continue
            have = prefills.get(rec.url)
            if have is None:
                prefills[rec.url] = PrefillMember(rec.url, rec.bootstrap_url, {rec.dp_rank: rec.member_id}, key)
            elif have.bootstrap_url != rec.bootstrap_url or have.key != key or rec.dp_rank in have.engines:
                conflicts.append(f"{rec.member_id} (dp {rec.dp_rank}) disagrees with the other ranks of {rec.url}")
            else:
                have.engines[rec.dp_rank] = rec.member_id
        else:
            if rec.url in prefills:
                conflicts.append(f"{rec.member_id} registers {rec.url} as decode, another engine as prefill")
                continue
            if decodes.setdefault(rec.url, key) != key:
                conflicts.append(f"{rec.member_id} disagrees with the other ranks of {rec.url}")
    return Membership(prefills, decodes, tuple(conflicts), events)


def compatible(p_key: CompatKey | None, d_key: CompatKey | None) -> bool:
    """Whether D can take P's KV: all but TP equal, and TP sizes one of which divides the other (each D rank takes
    its heads from the P ranks holding them); an unknown key (a backend from the command line) matches anything."""
    if p_key is None or d_key is None:
        return True
    (p_model, p_block, p_tp, *p_rest), (d_model, d_block, d_tp, *d_rest) = p_key, d_key
    return (p_model, p_block, p_rest) == (d_model, d_block, d_rest) and max(p_tp, d_tp) % min(p_tp, d_tp) == 0


def describe(key: CompatKey | None) -> str:
    if key is None:
        return "unknown (not in the registry)"
    model, block_size, tp, connector, transport = key
    return f"model {model!r}, block size {block_size}, TP {tp}, {connector}/{transport}"


def unmatched(p_keys: Mapping[str, CompatKey | None], d_keys: Mapping[str, CompatKey | None]) -> list[str]:
    """One line for every server that no server of the other role could be paired with (none when the
    other role has no server at all: that is a readiness matter, not a mismatch)."""
    notes: list[str] = []
    for role, mine, theirs, other in (("prefill", p_keys, d_keys, "decode"), ("decode", d_keys, p_keys, "prefill")):
        if not theirs:
            continue
        for url, key in mine.items():
            if not any(compatible(key, k) for k in theirs.values()):
                seen = sorted({describe(k) for k in theirs.values()})
                notes.append(f"{role} {url} ({describe(key)}) matches no {other} server ({'; '.join(seen)})")
    return notes

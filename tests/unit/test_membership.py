"""The members registry's pure parts: leases in `MemberTable`, records grouped by server, compatibility."""

from __future__ import annotations

import msgspec
import pytest

from pdkv.bootstrap.members import MemberTable
from pdkv.proxy.membership import compatible, group, unmatched
from pdkv.wire import MemberRecord

KEY = {"model": "tiny", "block_size": 32, "tp_size": 1, "transport": "tcp"}


def p(member_id: str, url: str = "http://198.18.0.2:8100", dp: int = 0, size: int = 1, **key) -> MemberRecord:
    return MemberRecord(member_id=member_id, role="prefill", url=url, bootstrap_url="http://198.18.0.2:8998", dp_rank=dp,
                        dp_size=size, **{**KEY, **key})


def d(member_id: str, url: str = "http://198.18.0.3:8200", **key) -> MemberRecord:
    return MemberRecord(member_id=member_id, role="decode", url=url, **{**KEY, **key})


def test_a_lease_is_renewed_by_put_and_runs_out_by_the_clock():
    table = MemberTable()
    assert table.put(d("a", ttl_s=10), now=0.0) is True
    assert table.put(d("a", ttl_s=10), now=8.0) is False  # a renewal is no change
    assert table.version == 1
    assert table.expire(now=17.9) == [] and len(table) == 1
    assert [r.member_id for r in table.expire(now=18.0)] == ["a"] and len(table) == 0 and table.version == 2


def test_a_changed_record_is_a_change_and_leave_removes_it():
    table = MemberTable()
    table.put(d("a"), 0.0)
    assert table.put(d("a", block_size=16), 1.0) is True
    assert table.leave("a") is True and table.leave("a") is False
    assert table.view(2.0).members == []


def test_view_lists_each_member_with_the_time_its_lease_has_left():
    table = MemberTable()
    table.put(p("p0"), 0.0)
    table.put(d("d0", ttl_s=5), 0.0)
    view = table.view(2.0)
    assert [(m.record.member_id, m.expires_in_s) for m in view.members] == [("d0", 3.0), ("p0", 13.0)]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"role": "prefill"}, "bootstrap_url"),
        ({"dp_rank": 1, "dp_size": 1}, "dp_rank"),
        ({"url": "10.0.0.1:8000"}, "http://HOST:PORT"),
        ({"ttl_s": 0.5}, "ttl_s"),
        ({"role": "router"}, "role"),
    ],
)
def test_records_that_cannot_be_routed_to_are_refused_when_decoded(fields, needle):
    raw = {"member_id": "x", "role": "decode", "url": "http://198.18.0.3:8200", **fields}
    with pytest.raises(msgspec.ValidationError, match=needle):
        msgspec.convert(raw, MemberRecord)


def test_dp_ranks_of_one_server_become_its_engines():
    view = group([p("e1", dp=1, size=2), p("e0", dp=0, size=2), d("d0")])
    assert view.prefills["http://198.18.0.2:8100"].engines == {0: "e0", 1: "e1"}
    assert list(view.decodes) == ["http://198.18.0.3:8200"] and view.conflicts == ()


def test_ranks_that_disagree_with_their_server_are_reported_not_merged():
    view = group([p("e0", dp=0, size=2), p("e1", dp=1, size=2, block_size=16), d("x", url="http://198.18.0.2:8100")])
    assert view.prefills["http://198.18.0.2:8100"].engines == {0: "e0"}
    assert len(view.conflicts) == 2
    assert any("e1" in c for c in view.conflicts) and any("x registers" in c for c in view.conflicts)


def test_compatibility_needs_every_field_but_tp_equal_and_unknown_matches_anything():
    k = p("a").compat_key()
    assert compatible(k, d("b").compat_key())
    for change in ({"model": "other"}, {"block_size": 16}, {"transport": "rdma"}, {"connector": "mooncake"}):
        assert not compatible(k, d("b", **change).compat_key()), change
    # TP sizes that divide each other pair: each D rank takes its heads from the P ranks holding them.
    assert compatible(k, d("b", tp_size=2).compat_key()) and compatible(p("a", tp_size=4).compat_key(), d("b", tp_size=2).compat_key())
    assert not compatible(p("a", tp_size=2).compat_key(), d("b", tp_size=3).compat_key())
    assert compatible(None, k) and compatible(k, None)


def test_unmatched_names_each_server_nothing_pairs_with():
    pk = {"http://p": p("a").compat_key()}
    notes = unmatched(pk, {"http://d16": d("b", block_size=16).compat_key(), "http://d32": d("c").compat_key()})
    assert len(notes) == 1 and notes[0].startswith("decode http://d16 (model 'tiny', block size 16")
    assert unmatched(pk, {}) == []  # no decode at all is a readiness matter

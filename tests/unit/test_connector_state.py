"""The per-transfer rules that keep P/D requests from hanging, without sockets or vLLM."""

from __future__ import annotations

from pdkv.connector.pulls import PullTracker
from pdkv.connector.send_table import Free, Phase, Reply, SendLimits, SendTable, StartSend, pull_key

LIMITS = SendLimits(unknown_wait_s=2.0, expiry_s=5.0, tombstone_s=10.0)


def table() -> SendTable:
    return SendTable(LIMITS)


def test_pull_after_ready_starts_the_send_at_once():
    t = table()
    assert t.registered("x", "p1", 0.0) == []
    assert t.ready("x", "p1", [3, 4, 5], 1.0) == []
    [a] = t.pull("x", "pull", 1.5)
    assert a == StartSend("x", "p1", [3, 4, 5], "pull")
    assert t.send_finished("x", None, 2.0) == [Free("x", "p1", "sent")]
    assert t.entries["x"].phase is Phase.CLOSED


def test_pull_before_ready_waits_then_sends_when_ready():
    t = table()
    t.registered("x", "p1", 0.0)
    assert t.pull("x", "pull", 0.1) == []
    assert t.parked_pulls() == [("x", "pull", None)]
    [a] = t.ready("x", "p1", [7], 0.5)
    assert isinstance(a, StartSend) and a.pull == "pull"


def test_pull_before_p_sees_the_transfer_is_kept_until_registration():
    t = table()
    assert t.pull("x", "pull", 0.0) == []
    assert t.entries["x"].phase is Phase.UNSEEN
    t.registered("x", "p1", 1.0)
    assert t.tick(100.0) == []  # registered: no unknown-transfer deadline any more
    [a] = t.ready("x", "p1", [1], 101.0)
    assert isinstance(a, StartSend)


def test_unknown_transfer_gets_an_error_once_the_wait_bound_passes():
    t = table()
    t.pull("ghost", "pull", 0.0)
    assert t.tick(1.9) == []
    [a] = t.tick(2.0)
    assert isinstance(a, Reply) and a.pull == "pull" and "never saw" in a.error
    # A second pull for the same id is answered at once, not after another wait.
    [b] = t.pull("ghost", "pull2", 2.5)
    assert isinstance(b, Reply) and "closed" in b.error


def test_cancel_answers_a_waiting_pull_at_once():
    t = table()
    t.registered("x", "p1", 0.0)
    t.pull("x", "pull", 0.1)
    [a] = t.cancelled("x", "aborted", 0.2)
    assert isinstance(a, Reply) and "aborted" in a.error
    # and one that comes later, too
    [b] = t.pull("x", "late", 0.3)
    assert isinstance(b, Reply) and "cancelled: aborted" in b.error


def test_cancel_before_any_pull_leaves_a_tombstone_that_expires():
    t = table()
    assert t.cancelled("x", "error", 0.0) == []
    assert "x" in t.entries
    t.tick(10.0)
    assert "x" not in t.entries


def test_blocks_nobody_pulls_are_freed_after_expiry():
    t = table()
    t.registered("x", "p1", 0.0)
    t.ready("x", "p1", [1, 2], 1.0)
    assert t.holding() == 1
    assert t.tick(5.9) == []
    assert t.tick(6.0) == [Free("x", "p1", "expired")]
    assert t.holding() == 0
    [late] = t.pull("x", "pull", 7.0)
    assert isinstance(late, Reply) and "expired" in late.error


def test_failed_send_frees_the_blocks_and_closes():
    t = table()
    t.ready("x", "p1", [1], 0.0)
    t.pull("x", "pull", 0.1)
    assert t.send_finished("x", "peer gone", 0.2) == [Free("x", "p1", "failed")]
    [r] = t.pull("x", "again", 0.3)
    assert "failed: peer gone" in r.error


def test_duplicate_pull_is_refused():
    t = table()
    t.registered("x", "p1", 0.0)
    t.pull("x", "a", 0.1)
    [r] = t.pull("x", "b", 0.2)
    assert isinstance(r, Reply) and r.pull == "b" and "in progress" in r.error
    t.ready("x", "p1", [1], 0.3)
    [r2] = t.pull("x", "c", 0.4)
    assert isinstance(r2, Reply) and r2.pull == "c"


def test_release_frees_ready_blocks_and_prevents_a_later_send():
    t = table()
    t.ready("x", "p1", [1], 0.0)
    assert t.released("x", 0.1) == [Free("x", "p1", "released")]
    t2 = table()
    t2.registered("y", "p2", 0.0)
    assert t2.released("y", 0.1) == []
    assert t2.ready("y", "p2", [1], 0.2) == [Free("y", "p2", "released")]


def test_ready_for_a_used_transfer_id_frees_at_once():
    t = table()
    t.ready("x", "p1", [1], 0.0)
    t.pull("x", "pull", 0.1)
    t.send_finished("x", None, 0.2)
    assert t.ready("x", "p9", [4], 0.3) == [Free("x", "p9", "duplicate")]


def test_computed_sends_before_the_request_finishes_and_frees_only_after():
    t = table()
    t.registered("x", "p1", 0.0)
    t.pull("x", "pull", 0.1)
    [a] = t.prompt_done("x", "p1", [3, 4], 0.2)
    assert a == StartSend("x", "p1", [3, 4], "pull")
    # The write ends before P's scheduler has finished the request: its blocks are not ours to free yet.
    assert t.send_finished("x", None, 0.3) == []
    assert t.ready("x", "p1", [3, 4], 0.4) == [Free("x", "p1", "sent")]
    assert t.ready("x", "p1", [3, 4], 0.5) == []


def test_computed_then_ready_then_pull_sends_once():
    t = table()
    assert t.prompt_done("x", "p1", [3], 0.0) == []
    assert t.tick(100.0) == []  # no expiry while the scheduler still holds the request
    assert t.ready("x", "p1", [3], 100.0) == []
    [a] = t.pull("x", "pull", 101.0)
    assert isinstance(a, StartSend)
    assert t.send_finished("x", None, 101.1) == [Free("x", "p1", "sent")]


def test_computed_blocks_expire_from_the_finish_not_the_forward():
    t = table()
    t.prompt_done("x", "p1", [3], 0.0)
    t.ready("x", "p1", [3], 50.0)
    assert t.tick(54.9) == []
    assert t.tick(55.0) == [Free("x", "p1", "expired")]


def test_release_or_failure_of_a_computed_transfer_frees_at_the_finish():
    t = table()
    t.prompt_done("x", "p1", [3], 0.0)
    assert t.released("x", 0.1) == []
    assert t.ready("x", "p1", [3], 0.2) == [Free("x", "p1", "released")]
    t2 = table()
    t2.pull("y", "pull", 0.0)
    t2.prompt_done("y", "p2", [1], 0.1)
    assert t2.send_finished("y", "peer gone", 0.2) == []
    assert t2.ready("y", "p2", [1], 0.3) == [Free("y", "p2", "failed")]


def test_computed_for_a_used_transfer_id_waits_for_the_finish_to_free():
    t = table()
    t.ready("x", "p1", [1], 0.0)
    t.pull("x", "pull", 0.1)
    t.send_finished("x", None, 0.2)
    assert t.prompt_done("x", "p9", [4], 0.3) == []
    assert t.ready("x", "p9", [4], 0.4) == [Free("x", "p9", "duplicate")]


def test_pull_tracker_fails_a_silent_peer_and_heartbeats_keep_it_alive():
    tr = PullTracker(liveness_s=1.0)
    tr.started("d1", "x", 0.0)
    tr.started("d2", "y", 0.0)
    tr.expect("d1", ["p0"], 0.0)
    tr.expect("d2", ["p0"], 0.0)
    tr.heard("d1", 0.9)
    [out] = tr.tick(1.0)
    assert out.d_req_id == "d2" and "silent" in (out.error or "")
    assert tr.tick(1.8) == []
    done = tr.finished("d1", None)
    assert done is not None and done.error is None
    assert tr.finished("d1", None) is None


def test_p_is_silent_only_from_when_it_was_asked():
    # Finding P's side channel (a bootstrap query on a busy host) is not P's silence: the bound restarts when P is
    # asked, and a pull that never got that far says so.
    tr = PullTracker(liveness_s=1.0)
    tr.started("slow", "x", 0.0)
    tr.started("never", "y", 0.0)
    tr.expect("slow", ["p0"], 0.9)
    [out] = tr.tick(1.0)
    assert out.d_req_id == "never" and "not reached" in (out.error or "") and "silent" not in (out.error or "")
    assert tr.tick(1.8) == []
    [out] = tr.tick(1.9)
    assert out.d_req_id == "slow" and "silent" in (out.error or "")


def test_pull_tracker_abort_turns_success_into_an_error():
    tr = PullTracker(liveness_s=1.0)
    tr.started("d1", "x", 0.0)
    tr.abort("d1")
    out = tr.finished("d1", None)
    assert out is not None and out.error == "aborted by the decode side"


class _Pull:
    """A parked pull as the sender keeps it: the D request it came from is `request.d_req_id`."""

    def __init__(self, d_req_id: str) -> None:
        self.request = type("Req", (), {"d_req_id": d_req_id})()

    def __repr__(self) -> str:
        return f"pull({self.request.d_req_id})"


def test_n_pulls_share_one_prefill_and_blocks_free_after_the_last():
    t = table()
    t.registered("x", "p1", 0.0, pulls=3)
    a, b, c = _Pull("0_d"), _Pull("1_d"), _Pull("2_d")
    assert t.pull("x", a, 0.1) == []
    starts = t.ready("x", "p1", [4, 5], 0.2)
    assert starts == [StartSend("x", "p1", [4, 5], a)]
    [sb] = t.pull("x", b, 0.3)  # the blocks are here: started at once, beside a's write
    assert sb.pull is b
    assert t.send_finished("x", None, 0.4, "0_d") == []
    assert t.send_finished("x", None, 0.5, "1_d") == []
    assert t.entries["x"].phase is Phase.READY  # one more choice to come
    [sc] = t.pull("x", c, 0.6)
    assert t.send_finished("x", None, 0.7, "2_d") == [Free("x", "p1", "sent")]
    [r] = t.pull("x", _Pull("3_d"), 0.8)
    assert isinstance(r, Reply) and "closed" in r.error


def test_a_pull_beyond_n_or_a_repeat_from_one_d_request_is_refused():
    t = table()
    t.registered("x", "p1", 0.0, pulls=2)
    t.ready("x", "p1", [1], 0.1)
    [s] = t.pull("x", _Pull("0_d"), 0.2)
    [again] = t.pull("x", _Pull("0_d"), 0.3)
    assert isinstance(again, Reply) and "in progress" in again.error
    t.pull("x", _Pull("1_d"), 0.4)
    [extra] = t.pull("x", _Pull("2_d"), 0.5)
    assert isinstance(extra, Reply) and "in progress" in extra.error


def test_pulls_before_registration_are_parked_then_trimmed_to_n():
    t = table()
    pulls = [_Pull(f"{i}_d") for i in range(3)]
    for p in pulls:
        assert t.pull("x", p, 0.0) == []
    [extra] = t.registered("x", "p1", 0.1, pulls=2)
    assert isinstance(extra, Reply) and extra.pull is pulls[2]
    starts = t.prompt_done("x", "p1", [7], 0.2)
    assert [s.pull for s in starts] == pulls[:2]


def test_one_choice_released_the_others_still_get_the_kv():
    t = table()
    t.registered("x", "p1", 0.0, pulls=2)
    t.ready("x", "p1", [1], 0.1)
    assert t.released("x", 0.2, "0_d") == []  # that choice had the prompt cached
    [s] = t.pull("x", _Pull("1_d"), 0.3)
    assert t.send_finished("x", None, 0.4, "1_d") == [Free("x", "p1", "sent")]


def test_a_release_from_the_d_request_being_written_is_settled_by_the_write():
    t = table()
    t.registered("x", "p1", 0.0, pulls=2)
    t.ready("x", "p1", [1], 0.1)
    t.pull("x", _Pull("0_d"), 0.2)
    assert t.released("x", 0.25, "0_d") == []
    assert t.send_finished("x", "peer gone", 0.3, "0_d") == []
    assert t.entries["x"].served == 1  # counted once: the second choice may still pull
    t.pull("x", _Pull("1_d"), 0.4)
    assert t.send_finished("x", None, 0.5, "1_d") == [Free("x", "p1", "failed")]


def test_computed_before_registration_learns_n_from_it():
    # `computed` runs on the model runner's thread and may overtake `registered` on the sender loop.
    t = table()
    assert t.prompt_done("x", "p1", [2], 0.0) == []
    t.registered("x", "p1", 0.0, pulls=2)
    t.ready("x", "p1", [2], 0.1)
    t.pull("x", _Pull("0_d"), 0.2)
    t.send_finished("x", None, 0.3, "0_d")
    [s] = t.pull("x", _Pull("1_d"), 0.4)
    assert isinstance(s, StartSend)


def test_choices_said_before_the_forward_take_every_pull_that_overtakes_registration():
    # Writing layer by layer, `prompt_done` (the forward begins) and both choices' pulls may all reach the table before
    # `registered` does on the sender loop: `expect`, said on the model runner's thread first, lets the second pull in.
    t = table()
    t.expect("x", 2)
    assert t.prompt_done("x", "p1", [2], 0.0) == []
    a, b = t.pull("x", _Pull("0_d"), 0.1), t.pull("x", _Pull("1_d"), 0.1)
    assert [type(x) for x in a + b] == [StartSend, StartSend]
    t.registered("x", "p1", 0.2, pulls=2)
    assert t.send_finished("x", None, 0.3, "0_d") == []
    assert t.send_finished("x", None, 0.4, "1_d") == []  # every choice served; the scheduler still holds the blocks
    assert t.ready("x", "p1", [2], 0.5) == [Free("x", "p1", "sent")]
    assert t.fanouts == {}


def test_choices_said_before_a_pull_parks_them_all_and_a_release_counts_against_them():
    t = table()
    t.expect("x", 3)
    assert t.pull("x", _Pull("0_d"), 0.0) == []
    assert t.released("x", 0.1, "1_d") == []  # one choice had the prompt cached: two still to be served
    assert t.entries["x"].phase is Phase.UNSEEN and t.entries["x"].expected == 3
    [s] = t.prompt_done("x", "p1", [4], 0.2)
    assert isinstance(s, StartSend)
    assert t.send_finished("x", None, 0.3, "0_d") == []
    assert t.entries["x"].phase is Phase.READY  # the third choice may still pull


def test_expiry_frees_a_transfer_whose_remaining_choices_never_pull():
    t = table()
    t.registered("x", "p1", 0.0, pulls=2)
    t.ready("x", "p1", [1], 0.1)
    t.pull("x", _Pull("0_d"), 0.2)
    t.send_finished("x", None, 0.3, "0_d")
    assert t.tick(5.2) == []
    assert t.tick(5.4) == [Free("x", "p1", "sent")]
    assert t.entries["x"].outcome == "expired"


def test_a_pull_being_written_still_gets_heartbeats():
    # A long write (a stalled Mooncake peer: up to its write timeout) must not look like a silent P to D.
    t = table()
    t.registered("x", "p1", 0.0)
    t.ready("x", "p1", [1], 0.1)
    p = _Pull("0_d")
    [s] = t.pull("x", p, 0.2)
    assert t.parked_pulls() == [("x", p, None)]
    t.send_finished("x", None, 0.3, "0_d")
    assert t.parked_pulls() == []


def test_a_failed_pull_names_every_block_it_wrote_into_and_others_name_none():
    tr = PullTracker(liveness_s=1.0)
    tr.started("ok", "x1", 0.0, (1, 2))
    tr.started("failed", "x2", 0.0, (3, 4, 5))
    tr.started("aborted", "x3", 0.0, (6,))
    tr.started("silent", "x4", 0.0, (7, 8))
    assert tr.finished("ok", None).failed_blocks == ()
    # P may have written any part of any block before it failed: none of them is trusted.
    assert tr.finished("failed", "peer gone").failed_blocks == (3, 4, 5)
    tr.abort("aborted")
    out = tr.finished("aborted", "peer gone")  # D's request is over: its blocks are vLLM's to free, not to recompute
    assert out.error and out.failed_blocks == ()
    [silent] = tr.tick(1.0)
    assert silent.failed_blocks == (7, 8)


def test_a_release_before_p_saw_the_transfer_is_a_bounded_tombstone_that_frees_the_blocks_when_they_come():
    # The proxy releases every transfer whose D never answered; P may not have seen it yet, or ever.
    t = table()
    assert t.released("x", 0.0) == []
    assert t.entries["x"].phase is Phase.CLOSED
    assert t.ready("x", "p1", [1], 1.0) == [Free("x", "p1", "duplicate")]
    t.released("never", 0.0)
    t.tick(LIMITS.tombstone_s + 1.0)
    assert "never" not in t.entries and "x" not in t.entries


class _RankPull:
    """A parked pull as the sender makes it where D's TP is larger than P's: named by request and D rank."""

    def __init__(self, d_req_id: str, rank: int) -> None:
        self.key = pull_key(d_req_id, rank, 2, 1)


def test_d_ranks_sharing_one_p_rank_each_get_their_write_and_blocks_free_after_the_last():
    # P TP 1, D TP 2: both D ranks of request d pull P rank 0, each for its half of the heads.
    t = table()
    t.registered("x", "p1", 0.0)
    r0, r1 = _RankPull("d", 0), _RankPull("d", 1)
    assert r0.key != r1.key
    assert t.pull("x", r0, 0.1, ranks=2) == []
    assert t.pull("x", r1, 0.1, ranks=2) == []
    s0, s1 = t.ready("x", "p1", [4, 5], 0.2)
    assert (s0.pull, s1.pull) == (r0, r1)
    assert t.send_finished("x", None, 0.3, r0.key) == []  # the other rank's write is still running
    assert t.send_finished("x", None, 0.4, r1.key) == [Free("x", "p1", "sent")]


def test_a_d_rank_pulling_after_the_other_finished_still_gets_the_kv():
    t = table()
    t.registered("x", "p1", 0.0)
    t.ready("x", "p1", [1], 0.1)
    [s0] = t.pull("x", _RankPull("d", 0), 0.2, ranks=2)
    assert t.send_finished("x", None, 0.3, s0.pull.key) == []
    assert t.entries["x"].phase is Phase.READY
    [s1] = t.pull("x", _RankPull("d", 1), 0.4, ranks=2)
    assert isinstance(s1, StartSend)
    assert t.send_finished("x", None, 0.5, s1.pull.key) == [Free("x", "p1", "sent")]
    [again] = t.pull("x", _RankPull("d", 1), 0.6, ranks=2)
    assert isinstance(again, Reply) and "closed" in again.error


def test_one_d_rank_released_the_other_rank_still_gets_the_kv():
    t = table()
    t.registered("x", "p1", 0.0)
    t.ready("x", "p1", [1], 0.1)
    [s0] = t.pull("x", _RankPull("d", 0), 0.2, ranks=2)
    assert t.released("x", 0.3, pull_key("d", 1, 2, 1)) == []
    assert t.send_finished("x", None, 0.4, s0.pull.key) == [Free("x", "p1", "sent")]


def test_a_pull_that_asks_several_p_ranks_ends_when_the_last_is_done_or_the_first_fails():
    tr = PullTracker(liveness_s=5.0)
    tr.started("d", "x", 0.0, (3, 4))
    tr.expect("d", ["p0", "p1"], 0.0)
    assert tr.part_done("d", "p0", 100, 2) is None
    assert tr.part_done("d", "p0", 100, 2) is None  # a repeat changes nothing
    assert tr.part_done("d", "elsewhere", 100, 2) is None
    out = tr.part_done("d", "p1", 100, 2)
    assert out is not None and out.error is None
    tr.started("e", "y", 0.0, (5,))
    tr.expect("e", ["p0", "p1"], 0.0)
    tr.part_done("e", "p0")
    failed = tr.finished("e", "p1: transfer failed")
    assert failed is not None and failed.failed_blocks == (5,)

"""P's and D's worker-side classes over real ZMQ, a real bootstrap server and real Mooncake tcp on loopback
(and, where a test says so, the cma transport: P and D are then one process writing into itself).

No vLLM: the scheduler's news is applied by hand, as the connector's
worker hooks would. Every wait is bounded in seconds.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from support.kv_pair import (
    BLOCK_LEN,
    ENGINE,
    LAYERS,
    assert_copied,
    assert_untouched,
    settle,
    wait_freed,
    wait_parked,
    wait_phase,
    wait_results,
)
from support.waiting import LogWatch, wait_for

from pdkv.connector.receiver import PullSpec
from pdkv.connector.sender import KVSender
from pdkv.connector.send_table import Phase, SendLimits
from pdkv.errors import TransferError
from pdkv.transport.descriptor_writes import DescriptorWrites


@pytest.mark.parametrize("transport", ["tcp", "cma", "socket"])
def test_pull_after_p_finished_copies_exactly_the_blocks(make_pair, transport):
    pair = make_pair(transport=transport)
    pair.sender.apply_step(registered={"p1": "x1"})
    computed = time.time()
    pair.sender.apply_step(ready={"p1": ("x1", [2, 3, 4, 9])}, ready_at={"p1": computed})
    wait_phase(pair.sender, "x1", Phase.READY)
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [5, 6, 7, 12])])
    res = wait_results(pair.receiver, {"d1"})
    assert res.failed == {}
    assert_copied(pair, [2, 3, 4, 9], [5, 6, 7, 12])
    assert_untouched(pair, [5, 6, 7, 12])
    wait_freed(pair.sender, {"p1"})
    trace = pair.sender.trace.get("x1")
    assert trace is not None and trace.status == "sent"
    assert trace.bytes == 4 * LAYERS * BLOCK_LEN
    assert trace.descriptors == 2 * LAYERS  # runs 2-4 -> 5-7 and 9 -> 12, per layer
    for ev in ("registered", "p_computed", "p_finished", "pull_received", "transfer_start", "transfer_end", "reply_sent"):
        assert ev in trace.events
    assert trace.events["p_computed"] == computed <= trace.events["p_finished"]
    if transport == "socket":
        assert len(pair.d.transport.grants) == 0  # the concluded pull's grant is gone


@pytest.mark.parametrize(("wait_write_s", "transport"), [(0.0, "tcp"), (0.5, "tcp"), (0.5, "cma"), (0.5, "socket")])
def test_computed_prompt_is_sent_before_p_finishes_and_freed_only_after(make_pair, wait_write_s, transport):
    pair = make_pair(wait_write_s=wait_write_s, transport=transport)
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [5, 6])])
    pair.sender.apply_step(registered={"p1": "x1"})
    wait_parked(pair.sender, "x1")
    pair.sender.prompt_done({"p1": ("x1", [2, 3])})  # the forward that completed P's prompt just ran
    if wait_write_s:
        # The model runner's thread stepped aside until the write was done and D told.
        assert "reply_sent" in pair.sender.trace.get("x1").events
    res = wait_results(pair.receiver, {"d1"})
    assert res.failed == {}
    assert_copied(pair, [2, 3], [5, 6])
    wait_for(lambda: pair.sender.trace.get("x1").status == "sent", 5, "P to conclude the send")
    settle(pair.sender)  # and to have done all it does when a send ends
    assert pair.sender.take_finished() == set()  # P's scheduler has not finished the request: not ours to free
    pair.sender.apply_step(ready={"p1": ("x1", [2, 3])})
    wait_freed(pair.sender, {"p1"})
    ev = pair.sender.trace.get("x1").events
    assert ev["p_forward_done"] <= ev["transfer_start"] <= ev["transfer_end"] <= ev["p_finished"]


@pytest.mark.parametrize(("p_transport", "d_transport"), [("tcp", "cma"), ("cma", "tcp"), ("socket", "tcp"), ("tcp", "socket")])
def test_p_and_d_on_different_transports_fail_the_pull_at_once_with_the_reason(make_pair, p_transport, d_transport):
    pair = make_pair(transport=p_transport, d_transport=d_transport)
    pair.sender.apply_step(registered={"p1": "x1"})
    pair.sender.apply_step(ready={"p1": ("x1", [2, 3])})
    start = time.monotonic()
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [5, 6])])
    res = wait_results(pair.receiver, {"d1"}, timeout=5.0)
    assert time.monotonic() - start < 3.0
    assert "same mooncake_protocol" in res.failed["d1"], res.failed
    assert_untouched(pair, [])
    wait_freed(pair.sender, {"p1"})


def test_idle_step_wait_returns_when_the_pull_concludes(make_pair):
    pair = make_pair()
    start = time.monotonic()
    pair.receiver.wait_results(5.0)  # nothing in flight: no wait at all
    assert time.monotonic() - start < 0.1
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [5])])
    pair.sender.apply_step(registered={"p1": "x1"})
    wait_parked(pair.sender, "x1")
    start = time.monotonic()
    threading.Timer(0.3, pair.sender.prompt_done, args=({"p1": ("x1", [1])},)).start()
    pair.receiver.wait_results(5.0)
    assert 0.25 < time.monotonic() - start < 2.0  # woke by the DONE, well before the bound
    assert pair.receiver.take_results().finished == {"d1"}
    start = time.monotonic()
    pair.receiver.wait_results(0.3)  # nothing in flight any more
    assert time.monotonic() - start < 0.1


def test_p_holding_blocks_waits_in_an_idle_step_until_the_send_concludes(make_pair):
    pair = make_pair()
    start = time.monotonic()
    assert not pair.sender.wait_finished(5.0)  # nothing held: nothing could come, no wait
    assert time.monotonic() - start < 0.1
    pair.sender.apply_step(registered={"p1": "x1"}, ready={"p1": ("x1", [3])})
    wait_phase(pair.sender, "x1", Phase.READY)
    start = time.monotonic()
    assert pair.sender.wait_finished(0.3)  # held, no pull: the whole bound, then the step goes on
    assert 0.25 < time.monotonic() - start < 1.0
    threading.Timer(0.3, pair.receiver.apply_step, kwargs={"pulls": [pair.spec("d1", "x1", [7])]}).start()
    start = time.monotonic()
    assert pair.sender.wait_finished(5.0)
    assert 0.25 < time.monotonic() - start < 2.0  # woke by the send's end, well before the bound
    start = time.monotonic()
    assert not pair.sender.wait_finished(5.0)  # news not yet taken: no wait
    assert time.monotonic() - start < 0.1
    assert pair.sender.take_finished() == {"p1"}
    assert_copied(pair, [3], [7])
    assert not pair.sender.wait_finished(5.0)  # nothing held any more


def test_d_request_that_never_pulls_releases_ps_blocks_at_once(make_pair):
    pair = make_pair()  # expiry stays at its 120 s default
    pair.sender.apply_step(registered={"p1": "x1"}, ready={"p1": ("x1", [4, 5])})
    pair.receiver.apply_step(releases=[pair.spec("d1", "x1", [])])
    assert wait_freed(pair.sender, {"p1"}, timeout=5.0) < 5.0
    assert pair.sender.trace.get("x1").status == "released"
    assert_untouched(pair, [])


def test_pull_before_p_finished_waits_then_arrives(make_pair):
    pair = make_pair()
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [0, 1])])  # D first, P has not even registered
    wait_parked(pair.sender, "x1")
    asked = pair.receiver.tracker.entries["d1"].deadline
    # A heartbeat from P (the transfer unknown there yet) keeps D waiting: its liveness deadline moves on.
    wait_for(lambda: pair.receiver.tracker.entries["d1"].deadline > asked, 5, "a heartbeat from P to reach D")
    assert pair.receiver.take_results().finished == set()
    pair.sender.apply_step(registered={"p1": "x1"}, ready={"p1": ("x1", [10, 11])})
    res = wait_results(pair.receiver, {"d1"})
    assert res.failed == {}
    assert_copied(pair, [10, 11], [0, 1])


def test_prefix_hit_on_d_pulls_only_the_missing_blocks(make_pair):
    pair = make_pair()
    pair.sender.apply_step(ready={"p1": ("x1", [1, 2, 3, 4])})
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [8, 9], first=2)])
    assert wait_results(pair.receiver, {"d1"}).failed == {}
    assert_copied(pair, [3, 4], [8, 9])
    assert_untouched(pair, [8, 9])


def test_cancelled_prefill_fails_the_waiting_pull_at_once(make_pair):
    pair = make_pair(liveness_s=5.0)
    pair.sender.apply_step(registered={"p1": "x1"})
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [0])])
    wait_parked(pair.sender, "x1")
    t0 = time.monotonic()
    pair.sender.apply_step(cancelled={"x1": "prefill request p1 finished as FINISHED_ABORTED"})
    res = wait_results(pair.receiver, {"d1"}, timeout=3)
    assert time.monotonic() - t0 < 1.0
    assert "FINISHED_ABORTED" in res.failed["d1"]
    assert_untouched(pair, [])


def test_pull_after_the_cancel_is_answered_at_once(make_pair):
    pair = make_pair(liveness_s=5.0)
    pair.sender.apply_step(cancelled={"x1": "prefill request p1 finished as FINISHED_ERROR"})
    wait_phase(pair.sender, "x1", Phase.CLOSED)
    t0 = time.monotonic()
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [0])])
    res = wait_results(pair.receiver, {"d1"}, timeout=3)
    assert time.monotonic() - t0 < 1.0 and "FINISHED_ERROR" in res.failed["d1"]


def test_unknown_transfer_fails_once_ps_wait_bound_passes(make_pair):
    pair = make_pair(SendLimits(unknown_wait_s=0.8), liveness_s=5.0)
    t0 = time.monotonic()
    pair.receiver.apply_step(pulls=[pair.spec("d1", "never-seen", [0])])
    res = wait_results(pair.receiver, {"d1"}, timeout=5)
    elapsed = time.monotonic() - t0
    assert 0.7 <= elapsed < 2.5
    assert "never saw" in res.failed["d1"]


def test_blocks_nobody_pulls_are_freed_after_expiry(make_pair):
    pair = make_pair(SendLimits(expiry_s=0.5))
    pair.sender.apply_step(ready={"p1": ("x1", [1])})
    waited = wait_freed(pair.sender, {"p1"}, timeout=3)
    assert 0.3 <= waited < 2.0
    assert pair.sender.trace.get("x1").status == "expired"


def test_p_closing_its_side_channel_fails_the_pull_at_once(make_pair):
    pair = make_pair(liveness_s=30.0)
    pair.sender.apply_step(registered={"p1": "x1"})
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [0])])
    wait_parked(pair.sender, "x1")
    pair.sender.close()  # P's worker is gone: its socket closes, as a killed process's does
    t0 = time.monotonic()
    res = wait_results(pair.receiver, {"d1"}, timeout=5)
    assert time.monotonic() - t0 < 1.0  # not the 30 s liveness bound
    assert "lost the connection" in res.failed["d1"]


def test_a_p_that_stops_answering_fails_the_pull_within_the_liveness_bound(make_pair):
    pair = make_pair(liveness_s=1.0)
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [0])])
    wait_parked(pair.sender, "x1")
    pair.sender._ticker.cancel()  # P's loop lives (its socket stays open) but it sends no heartbeat
    t0 = time.monotonic()
    res = wait_results(pair.receiver, {"d1"}, timeout=5)
    assert time.monotonic() - t0 < 2.0
    assert "silent" in res.failed["d1"]


def test_unreachable_bootstrap_fails_the_pull(make_pair):
    pair = make_pair()
    spec = PullSpec("d1", "x1", "http://127.0.0.1:9", ENGINE, [0])
    pair.receiver.apply_step(pulls=[spec])
    res = wait_results(pair.receiver, {"d1"}, timeout=10)
    assert "cannot reach the prefill engine" in res.failed["d1"]


def test_d_dying_before_the_write_frees_ps_blocks_and_reports(make_pair):
    pair = make_pair()
    pair.sender.apply_step(registered={"p1": "x1"})
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [0])])
    wait_parked(pair.sender, "x1")
    pair.d.transport.close()  # D's memory and transfer engine are gone
    pair.sender.apply_step(ready={"p1": ("x1", [3])})
    waited = wait_freed(pair.sender, {"p1"}, timeout=8)
    assert waited < 5.0
    t = pair.sender.trace.get("x1")
    assert t.status == "failed" and t.error


def test_decode_abort_releases_ps_blocks(make_pair):
    pair = make_pair()
    pair.sender.apply_step(registered={"p1": "x1"})
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [0])])
    wait_parked(pair.sender, "x1")
    pair.receiver.apply_step(aborts=["d1"])
    res = wait_results(pair.receiver, {"d1"}, timeout=3)
    assert "d1" in res.failed
    pair.sender.apply_step(ready={"p1": ("x1", [3])})
    wait_freed(pair.sender, {"p1"}, timeout=3)
    assert_untouched(pair, [])


def test_equal_tp_each_rank_pulls_from_its_own_prefill_rank(kv):
    # TP 2 on both sides: each D worker pulls the same blocks from the P worker of its rank, whose memory
    # holds its own share of the heads; the bootstrap lists both P ranks under one engine id.
    ps = [kv.side(fill=10 + rank) for rank in range(2)]
    ds = [kv.side(fill=None) for _ in range(2)]
    senders = [kv.sender(p, engine_id="engine-tp", tp_rank=rank, tp_size=2) for rank, p in enumerate(ps)]
    receivers = [kv.receiver(d, tp_rank=rank, tp_size=2) for rank, d in enumerate(ds)]
    spec = PullSpec("d1", "x-tp", kv.bootstrap_url, "engine-tp", [5, 6, 7])
    for rx in receivers:  # the scheduler's metadata reaches every worker alike
        rx.apply_step(pulls=[spec])
    for sender in senders:
        sender.apply_step(registered={"p1": "x-tp"}, ready={"p1": ("x-tp", [1, 2, 3])})
    for rank, rx in enumerate(receivers):
        assert wait_results(rx, {"d1"}).failed == {}
        for layer in range(LAYERS):
            for pb, db in zip([1, 2, 3], [5, 6, 7], strict=True):
                assert np.array_equal(ps[rank].block(layer, pb), ds[rank].block(layer, db)), f"rank {rank} layer {layer}"
    assert not np.array_equal(ds[0].mem, ds[1].mem)  # each rank got its own P rank's bytes
    for sender in senders:
        wait_freed(sender, {"p1"})


def test_unequal_tp_fails_the_pull_at_once_with_the_reason(kv, make_pair):
    pair = make_pair()  # P registered TP 1
    rx = kv.receiver(kv.side(fill=None), tp_rank=0, tp_size=2, liveness_s=5.0)
    start = time.monotonic()
    rx.apply_step(pulls=[pair.spec("d1", "x1", [1])])
    res = wait_results(rx, {"d1"}, timeout=5.0)
    assert time.monotonic() - start < 3.0
    assert "unequal TP" in res.failed["d1"]


class _HalfThenStall(DescriptorWrites):
    """P's transport for one test: writes the first half of a transfer's descriptors, then stalls until released."""

    transport = "tcp"

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.half_written = threading.Event()
        self.release = threading.Event()

    def write(self, peer: str, descriptors: list, *, transfer: str = "") -> None:
        self.inner.write(peer, descriptors[: len(descriptors) // 2])
        self.half_written.set()
        self.release.wait(10)


def test_a_transfer_cut_half_way_reports_every_block_of_the_pull_failed(make_pair):
    # Half of the KV landed when P's side channel went away: none of the pull's blocks may be trusted.
    pair = make_pair(liveness_s=30.0)
    stall = _HalfThenStall(pair.p.transport)
    pair.sender.transport = stall
    blocks = [4, 5, 6, 9]
    pair.sender.apply_step(registered={"p1": "x1"}, ready={"p1": ("x1", [0, 1, 2, 3])})
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", blocks), pair.spec("d2", "x2", [11])])
    assert stall.half_written.wait(5)
    assert any(pair.d.block(0, b).any() for b in blocks)  # some bytes did land
    pair.sender.close()
    stall.release.set()
    res = wait_results(pair.receiver, {"d1", "d2"}, timeout=5)
    assert "lost the connection" in res.failed["d1"]
    assert res.failed_blocks["d1"] == tuple(blocks) and res.failed_blocks["d2"] == (11,)


def test_a_pull_to_a_prefill_whose_side_channel_is_gone_fails_at_once(make_pair):
    pair = make_pair(liveness_s=30.0)
    pair.sender.apply_step(registered={"p1": "x1"}, ready={"p1": ("x1", [0])})
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [0])])
    assert wait_results(pair.receiver, {"d1"}).failed == {}
    with LogWatch("pdkv.connector") as logs:
        pair.sender.close()
        logs.wait(f"connection to {pair.sender.address} lost", timeout=5)  # D saw the connection end
    t0 = time.monotonic()
    pair.receiver.apply_step(pulls=[pair.spec("d2", "x2", [1])])
    res = wait_results(pair.receiver, {"d2"}, timeout=5)
    assert time.monotonic() - t0 < 1.0 and "gone" in res.failed["d2"]
    assert res.failed_blocks["d2"] == (1,)


def test_a_p_that_forgot_ds_regions_refuses_the_pull_and_d_announces_again(make_pair):
    pair = make_pair()
    pair.sender.apply_step(registered={"p1": "x1", "p2": "x2", "p3": "x3"})
    pair.sender.apply_step(ready={"p1": ("x1", [1]), "p2": ("x2", [2]), "p3": ("x3", [3])})
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [4])])
    assert wait_results(pair.receiver, {"d1"}).failed == {}
    pair.sender._loop.submit(_forget(pair.sender)).result(5)  # as if P's table of announcements dropped D's
    pair.receiver.apply_step(pulls=[pair.spec("d2", "x2", [5])])
    assert "has not announced" in wait_results(pair.receiver, {"d2"}).failed["d2"]
    pair.receiver.apply_step(pulls=[pair.spec("d3", "x3", [6])])
    assert wait_results(pair.receiver, {"d3"}).failed == {}
    assert_copied(pair, [1, 3], [4, 6])
    assert_untouched(pair, [4, 6])


async def _forget(sender: KVSender) -> None:
    sender._announced.clear()


def test_socket_d_lets_a_pull_write_only_its_own_blocks_and_nothing_after_it_concluded(make_pair):
    """Over socket D grants each pull its blocks: a P writing one pull's bytes into another pull's blocks is refused
    before a byte lands, and once a pull concluded (here: it failed on D's side) a late write of it is refused."""
    from pdkv.connector.pulls import write_key

    pair = make_pair(transport="socket", liveness_s=30.0)
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [5, 6]), pair.spec("d2", "x2", [9])])
    grants = pair.d.transport.grants
    wait_for(lambda: len(grants) == 2, 5, "D to grant both pulls")
    p = pair.p.transport
    with pytest.raises(TransferError, match="outside what transfer"):
        p.write_blocks(pair.d.transport.session_address, [0], [9], pair.p.regions, pair.d.regions, transfer=write_key("x1", "d1"))
    assert_untouched(pair, [])
    pair.sender.apply_step(registered={"p1": "x1"}, ready={"p1": ("x1", [2, 3])})
    res = wait_results(pair.receiver, {"d1"})
    assert res.failed == {} and len(grants) == 1  # d2's pull is still waiting
    assert_copied(pair, [2, 3], [5, 6])
    with pytest.raises(TransferError, match="no transfer"):
        p.write_blocks(pair.d.transport.session_address, [0], [5], pair.p.regions, pair.d.regions, transfer=write_key("x1", "d1"))


class HeldFence:
    """A GPU event of a forward still running, as a write sees it: synchronize() returns once `finish()` is called."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1
        assert self._done.wait(10), "the forward never finished"

    def finish(self) -> None:
        self._done.set()


def test_one_write_after_the_forward_every_pull_of_a_transfer_waits_for_the_forwards_event(make_pair):
    """Two choices (n = 2) of one prompt, one write each after P's forward (not layer by layer): the second pull must
    wait for the forward's event as the first does, or it could read KV the GPU has not written yet."""
    pair = make_pair(transport="socket")
    fence = HeldFence()
    items = {"p1": ("x1", [1, 2, 3])}
    pair.sender.apply_step(registered={"p1": "x1"}, fanout={"x1": 2})
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [7, 8, 9])])
    wait_parked(pair.sender, "x1")
    pair.sender.prompt_done(items, fence)  # the forward may still run: its writes wait for the event
    pair.receiver.apply_step(pulls=[pair.spec("d2", "x1", [10, 11, 12])])
    wait_for(lambda: fence.waits == 2, 5, "both pulls' writes to wait for the forward's event")
    assert not any(pair.d.block(0, b).any() for b in (7, 8, 9, 10, 11, 12))  # no byte before the forward ended
    fence.finish()
    assert wait_results(pair.receiver, {"d1", "d2"}).failed == {}
    assert_copied(pair, [1, 2, 3], [7, 8, 9])
    assert_copied(pair, [1, 2, 3], [10, 11, 12])

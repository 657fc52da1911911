"""The kv-aware cost model, pure: D by load and what it holds, local prefill, P by uncached work + queue
(or, with nothing cached anywhere, by requests in flight)."""

from __future__ import annotations

import pytest

from pdkv.proxy.kv.policy import DecodeCandidate, KvWeights, PrefillCandidate, RouteReason, hit_tokens, place_request

BS = 32
W = KvWeights(local_prefill_tokens=64)


def test_hit_tokens_are_whole_blocks_and_never_the_block_of_the_last_prompt_token():
    # vLLM computes the prompt's last token (it needs its logits) and takes only whole blocks from its cache.
    assert hit_tokens(4, BS, 128) == 96
    assert hit_tokens(4, BS, 129) == 128
    assert hit_tokens(2, BS, 128) == 64
    assert hit_tokens(0, BS, 128) == 0
    assert hit_tokens(1, BS, 0) == 0


def test_prefill_goes_where_the_prefix_is():
    placement = place_request(1000, BS, [PrefillCandidate(0, 0), PrefillCandidate(20, 0)], [DecodeCandidate(0, 0)], W)
    assert placement.prefill == 1 and placement.reason is RouteReason.PREFIX_HIT
    assert placement.p_hit_tokens == 640 and placement.p_costs == (1000.0, 360.0)
    assert "P1 holds 640/1000" in placement.summary()


def test_queued_prefill_work_outweighs_a_small_hit():
    busy = PrefillCandidate(hit_blocks=2, queued_tokens=2000)
    idle = PrefillCandidate(hit_blocks=0, queued_tokens=0)
    assert place_request(1000, BS, [busy, idle], [DecodeCandidate(0, 0)], W).prefill == 1
    # With the queue weighted at zero, the hit alone decides.
    assert place_request(1000, BS, [busy, idle], [DecodeCandidate(0, 0)], KvWeights(queue_weight=0.0, local_prefill_tokens=0)).prefill == 0


def test_no_hits_anywhere_is_least_cost_and_ties_rotate():
    ps = [PrefillCandidate(0, 0), PrefillCandidate(0, 0)]
    chosen = {place_request(500, BS, ps, [DecodeCandidate(0, 0)], W, start=s).prefill for s in range(4)}
    assert chosen == {0, 1}
    assert place_request(500, BS, ps, [DecodeCandidate(0, 0)], W).reason is RouteReason.LEAST_COST


def test_with_nothing_to_gain_prefill_is_chosen_as_least_outstanding_chooses():
    # P0 has fewer queued tokens but more requests in flight (its requests finish later): no P holds any of the
    # prompt, so the requests in flight decide, whatever the start.
    ps = [PrefillCandidate(0, queued_tokens=0, outstanding=5), PrefillCandidate(0, queued_tokens=3000, outstanding=2)]
    for s in range(3):
        placement = place_request(500, BS, ps, [DecodeCandidate(0, 0)], W, start=s)
        assert placement.prefill == 1 and placement.reason is RouteReason.LEAST_COST and placement.p_costs == (5.0, 2.0)
    assert "P in flight [5, 2]" in placement.summary()
    # A hit of a single block anywhere brings the token costs back: then the queue counts, not the requests.
    ps = [PrefillCandidate(1, queued_tokens=0, outstanding=5), PrefillCandidate(0, queued_tokens=3000, outstanding=2)]
    placement = place_request(500, BS, ps, [DecodeCandidate(0, 0)], W)
    assert placement.prefill == 0 and placement.reason is RouteReason.PREFIX_HIT and placement.p_costs == (468.0, 3500.0)
    assert "P costs [468, 3500]" in placement.summary()
    # A one-block prompt: its only block is never taken from a cache (the last token is computed), so nothing to gain.
    ps = [PrefillCandidate(1, queued_tokens=0, outstanding=5), PrefillCandidate(0, queued_tokens=0, outstanding=2)]
    assert place_request(BS, BS, ps, [DecodeCandidate(0, 0)], KvWeights(local_prefill_tokens=0)).prefill == 1


def test_decode_holding_the_history_serves_alone():
    ps = [PrefillCandidate(30, 0)]
    # 1000-token prompt; D holds 30 blocks (960 tokens): 40 missing <= 64, so no P and no transfer.
    placement = place_request(1000, BS, ps, [DecodeCandidate(30, 1)], W)
    assert placement.prefill is None and placement.reason is RouteReason.LOCAL_PREFILL and placement.d_hit_tokens == 960
    assert placement.summary().startswith("local_prefill: D0 holds 960/1000")
    # Threshold 0: always P/D.
    assert place_request(1000, BS, ps, [DecodeCandidate(30, 1)], KvWeights(local_prefill_tokens=0)).prefill == 0
    # A short prompt is not worth a transfer either.
    assert place_request(40, BS, ps, [DecodeCandidate(0, 0)], W).prefill is None


def test_decode_by_load_then_by_what_it_holds():
    ds = [DecodeCandidate(hit_blocks=0, outstanding=4), DecodeCandidate(hit_blocks=0, outstanding=1)]
    assert place_request(1000, BS, [PrefillCandidate(0, 0)], ds, W).decode == 1
    # Equal load: the one holding more of the prompt needs the smaller transfer.
    ds = [DecodeCandidate(hit_blocks=10, outstanding=1), DecodeCandidate(hit_blocks=0, outstanding=1)]
    placement = place_request(1000, BS, [PrefillCandidate(0, 0)], ds, W)
    assert placement.decode == 0 and placement.d_hit_tokens == 320 and placement.prefill == 0
    # KV usage near full counts against a D.
    ds = [DecodeCandidate(0, 0, kv_usage=0.95), DecodeCandidate(0, 0, kv_usage=0.1)]
    assert place_request(1000, BS, [PrefillCandidate(0, 0)], ds, W).decode == 1


def test_unkeyed_requests_route_by_load_and_no_prefill_means_local():
    placement = place_request(0, BS, [PrefillCandidate(0, 0, outstanding=3), PrefillCandidate(0, 900, outstanding=1)],
                              [DecodeCandidate(0, 0)], W, keyed=False)
    assert placement.prefill == 1 and placement.reason is RouteReason.UNKEYED
    assert place_request(1000, BS, [], [DecodeCandidate(0, 0)], W).prefill is None
    with pytest.raises(ValueError):
        place_request(10, BS, [PrefillCandidate(0, 0)], [], W)

"""Scheduler-side rules: who sends, who is cancelled, what D pulls. Requests are plain records here."""

from __future__ import annotations

import time

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import pytest

from pdkv.connector.layout import TensorInfo, memory_ranges, refusal, regions_for_caches, regions_for_layer
from pdkv.connector.scheduler import ConnectorScheduler
from pdkv.errors import UnsupportedModelError
from pdkv.wire import Region


class Status(Enum):
    RUNNING = 0
    FINISHED_LENGTH_CAPPED = 1
    FINISHED_STOPPED = 2
    FINISHED_ABORTED = 3
    FINISHED_ERROR = 4


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    status: Status = Status.RUNNING
    num_computed_tokens: int = 0
    max_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Blocks:
    ids: list[int] = field(default_factory=list)

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]


@dataclass
class Cached:
    req_ids: list[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class Out:
    """The fields of vLLM's SchedulerOutput the connector reads."""

    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached | None = None
    total_num_scheduled_tokens: int = -1


def p_req(n: int = 100, tid: str = "xfer-1", max_tokens: int | None = 1) -> Req:
    r = Req("p1", list(range(n)), {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid})
    r.max_tokens = max_tokens
    return r


def d_req(n: int = 100, **over: Any) -> Req:
    params = {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": "http://h:8998", "remote_engine_id": "e",
        "transfer_id": "xfer-1",
    }
    params.update(over)
    return Req("d1", list(range(n)), params)


def producer() -> ConnectorScheduler:
    return ConnectorScheduler(is_producer=True, is_consumer=False, block_size=32)


def consumer() -> ConnectorScheduler:
    return ConnectorScheduler(is_producer=False, is_consumer=True, block_size=32)


@pytest.mark.parametrize("status", [Status.FINISHED_LENGTH_CAPPED, Status.FINISHED_STOPPED])
def test_p_sends_on_every_finish_that_computed_the_prompt(status):
    s = producer()
    r = p_req(100)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, Blocks([5, 6, 7, 8]), 0)
    assert s.build_meta(None).registered == {"p1": "xfer-1"}
    r.status, r.num_computed_tokens = status, 100
    before = time.time()
    assert s.request_finished(r, [5, 6, 7, 8, 9]) == (True, None)
    assert s.has_pending_push_work()
    meta = s.build_meta(None)
    assert meta.ready == {"p1": ("xfer-1", [5, 6, 7, 8])}  # ceil(100/32) = 4 blocks hold the prompt
    # Step 23's time travels with the block ids, so a trace can split P's prefill from its next step.
    assert before <= meta.ready_at["p1"] <= time.time()
    assert not s.has_pending_push_work()


def test_one_token_p_request_is_announced_computed_in_the_step_that_completes_its_prompt():
    s = producer()
    r = p_req(100)
    s.update_state_after_alloc(r, Blocks([5, 6]), 0)
    s.build_meta(Out({"p1": 64}, [NewReq("p1", ([5, 6],))]))  # first chunk: 64 of 100 tokens
    r.num_computed_tokens = 64
    # The last chunk brings blocks 7, 8: the forward of this step completes the prompt.
    meta = s.build_meta(Out({"p1": 36}, scheduled_cached_reqs=Cached(["p1"], [([7, 8],)])))
    assert meta.prompt_done == {"p1": ("xfer-1", [5, 6, 7, 8])}
    r.num_computed_tokens = 100
    assert s.build_meta(Out({"p1": 1})).prompt_done == {}  # announced once
    # Announced requests keep their blocks after they finish, even aborted: a write may be reading them.
    r.status = Status.FINISHED_ABORTED
    assert s.request_finished(r, [5, 6, 7, 8]) == (True, None)
    assert s.build_meta(None).ready == {"p1": ("xfer-1", [5, 6, 7, 8])}


def test_resumed_p_request_replaces_its_blocks():
    s = producer()
    r = p_req(64)
    s.update_state_after_alloc(r, Blocks([1]), 0)
    s.build_meta(Out({"p1": 32}, [NewReq("p1", ([1],))]))
    r.num_computed_tokens = 0  # preempted, then resumed on new blocks
    meta = s.build_meta(Out({"p1": 64}, scheduled_cached_reqs=Cached(["p1"], [([8, 9],)], {"p1"})))
    assert meta.prompt_done == {"p1": ("xfer-1", [8, 9])}


@pytest.mark.parametrize("max_tokens", [None, 2, 16])
def test_p_request_that_may_outlive_its_prompt_is_not_announced_early(max_tokens):
    # It could be preempted after the prompt and its blocks reused mid-write: it sends once it finishes.
    s = producer()
    r = p_req(64, max_tokens=max_tokens)
    s.update_state_after_alloc(r, Blocks([1, 2]), 0)
    assert s.build_meta(Out({"p1": 64}, [NewReq("p1", ([1, 2],))])).prompt_done == {}
    r.status, r.num_computed_tokens = Status.FINISHED_ABORTED, 64
    assert s.request_finished(r, [1, 2]) == (False, None)


@pytest.mark.parametrize("status", [Status.FINISHED_ABORTED, Status.FINISHED_ERROR])
def test_p_aborted_or_failed_cancels_at_once(status):
    s = producer()
    r = p_req(100)
    r.status, r.num_computed_tokens = status, 100
    assert s.request_finished(r, [1, 2, 3, 4]) == (False, None)
    meta = s.build_meta(None)
    assert status.name in meta.cancelled["xfer-1"] and not meta.ready


def test_p_finishing_before_the_prompt_is_computed_cancels():
    s = producer()
    r = p_req(100)
    r.status, r.num_computed_tokens = Status.FINISHED_LENGTH_CAPPED, 64
    assert s.request_finished(r, [1, 2]) == (False, None)
    assert "before its prompt was computed" in s.build_meta(None).cancelled["xfer-1"]


def test_d_pulls_the_whole_prompt_without_a_local_hit():
    s = consumer()
    r = d_req(100)
    assert s.get_num_new_matched_tokens(r, 0) == (100, True)
    s.update_state_after_alloc(r, Blocks([40, 41, 42, 43]), 100)
    [spec] = s.build_meta(None).pulls
    assert spec.block_ids == [40, 41, 42, 43] and spec.first_block == 0 and spec.error is None
    assert r.kv_transfer_params["do_remote_prefill"] is False  # one transfer per request
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)


def test_d_with_a_prefix_hit_pulls_only_what_it_lacks():
    s = consumer()
    r = d_req(100)
    assert s.get_num_new_matched_tokens(r, 64) == (36, True)
    s.update_state_after_alloc(r, Blocks([7, 9, 40, 41]), 36)
    [spec] = s.build_meta(None).pulls
    assert spec.first_block == 2 and spec.block_ids == [40, 41]


def test_d_invalid_params_become_a_pull_that_fails_at_once():
    s = consumer()
    r = d_req(10, remote_bootstrap_addr="h:8998")
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks([1]), 10)
    [spec] = s.build_meta(None).pulls
    assert spec.error is not None and "http" in spec.error


def test_d_abort_during_the_pull_is_sent_to_the_worker_and_first_token_is_timed():
    s = consumer()
    r = d_req(40)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, Blocks([1, 2]), 40)
    s.build_meta(None)
    r.status = Status.FINISHED_ABORTED
    assert s.request_finished(r, [1, 2]) == (False, None)
    assert s.build_meta(None).aborts == ["d1"]
    r2 = d_req(40)
    r2.request_id = "d2"
    s.get_num_new_matched_tokens(r2, 0)
    s.update_state_after_alloc(r2, Blocks([3, 4]), 40)
    s.build_meta(None)
    s.update_connector_output({"d2"}, set())
    assert s.build_meta(Out({"other": 1})).first_tokens == {}
    [(at, ntok)] = s.build_meta(Out({"d2": 1})).first_tokens.values()
    assert ntok == 1 and at > 0


def test_d_request_ending_before_it_pulls_releases_ps_blocks():
    s = consumer()
    r = d_req(100)
    assert s.get_num_new_matched_tokens(r, 0) == (100, True)  # waiting, never allocated
    r.status = Status.FINISHED_ABORTED
    assert s.request_finished(r, []) == (False, None)
    [rel] = s.build_meta(None).releases
    assert (rel.d_req_id, rel.transfer_id, rel.engine_id, rel.bootstrap_addr) == ("d1", "xfer-1", "e", "http://h:8998")
    assert s.request_finished(r, []) == (False, None)
    assert s.build_meta(None).releases == []  # once


def test_d_with_the_whole_prompt_cached_releases_instead_of_pulling():
    s = consumer()
    r = d_req(64)
    s.update_state_after_alloc(r, Blocks([1, 2]), 0)
    meta = s.build_meta(None)
    assert meta.pulls == [] and [x.transfer_id for x in meta.releases] == ["xfer-1"]


def test_d_invalid_params_have_no_p_to_release():
    s = consumer()
    r = d_req(10, remote_engine_id="")
    r.status = Status.FINISHED_ABORTED
    s.request_finished(r, [])
    assert s.build_meta(None).releases == []


def test_a_step_that_computes_nothing_is_marked_idle():
    s = consumer()
    assert s.build_meta(Out({}, total_num_scheduled_tokens=0)).idle
    assert not s.build_meta(Out({"d9": 1}, total_num_scheduled_tokens=1)).idle
    assert not s.build_meta(None).idle  # unknown: never wait


def test_requests_without_pd_params_are_left_alone():
    s = consumer()
    r = Req("x", [1, 2, 3], None)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.request_finished(r, [1]) == (False, None)
    assert s.build_meta(None).empty()


# --- layout -------------------------------------------------------------------


def test_lbhnc_layer_is_one_region_of_dense_pages():
    t = TensorInfo("model.layers.0.attn", 4096, (10, 4, 32, 32), (4 * 32 * 32, 32 * 32, 32, 1), 2)
    assert regions_for_layer(t, 10) == [Region(4096, 4 * 32 * 32 * 2, 10)]


def test_kv_split_layer_is_two_regions():
    t = TensorInfo("l0", 0, (2, 10, 32, 2, 32), (10 * 2048, 2048, 64, 32, 1), 2)
    assert regions_for_layer(t, 10) == [Region(0, 4096, 10), Region(10 * 2048 * 2, 4096, 10)]


def test_padded_or_interleaved_blocks_are_refused():
    t = TensorInfo("l0", 0, (10, 4, 32, 32), (8192, 32 * 32, 32, 1), 2)  # a block stride larger than the page
    with pytest.raises(UnsupportedModelError, match="dense pages"):
        regions_for_layer(t, 10)
    with pytest.raises(UnsupportedModelError):
        regions_for_layer(TensorInfo("l0", 0, (7, 4), (4, 1), 2), 10)


def test_shared_layers_count_once_and_memory_ranges_merge():
    a = TensorInfo("l0", 0, (4, 8), (8, 1), 1)
    b = TensorInfo("l1", 32, (4, 8), (8, 1), 1)
    regions = regions_for_caches([a, b, a], 4)
    assert regions == [Region(0, 8, 4), Region(32, 8, 4)]
    assert memory_ranges(regions) == [(0, 64)]


def test_refusals_name_the_unsupported_feature():
    assert "MLA" in refusal(use_mla=True, kv_groups=1, sliding_window=False)
    assert "hybrid" in refusal(use_mla=False, kv_groups=2, sliding_window=False, spec_names=["A", "B"])
    assert "sliding" in refusal(use_mla=False, kv_groups=1, sliding_window=True)
    assert refusal(use_mla=False, kv_groups=1, sliding_window=False) is None


def test_a_prefill_for_n_choices_tells_the_worker_how_many_pulls_to_serve():
    s = ConnectorScheduler(is_producer=True, is_consumer=False, block_size=4)
    r = Req("p1", list(range(8)), {"do_remote_decode": True, "transfer_id": "x", "pulls": 4}, max_tokens=1)
    s.update_state_after_alloc(r, Blocks([0, 1]), 0)
    meta = s.build_meta()
    assert meta.registered == {"p1": "x"} and meta.fanout == {"x": 4}
    bad = Req("p2", list(range(8)), {"do_remote_decode": True, "transfer_id": "y", "pulls": 0}, max_tokens=1)
    s.update_state_after_alloc(bad, Blocks([2, 3]), 0)
    meta = s.build_meta()
    assert meta.registered == {"p2": "y"} and meta.fanout == {}  # invalid: one pull, logged

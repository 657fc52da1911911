"""The pure assembly of a trace: the seed's phases from real records, their sum, clocks, transfer facts, p50/p90."""

from __future__ import annotations

import msgspec
import pytest

from pdkv.geometry import size_transfer
from pdkv.trace.assemble import assemble, link_floor_ms, percentile, summarize
from pdkv.trace.collect import one_host
from support.trace_records import (
    E,
    P_COMPUTED,
    REAL_CLIENT,
    REAL_CONNECTOR,
    REAL_PROXY,
    SEED_PHASES,
    TINY,
    client_timing,
    connector_record,
    ms,
    near,
    proxy_record,
    rel,
)

def test_real_records_give_the_seed_phases_adding_up_to_ttft() -> None:
    t = assemble(proxy_record(), [connector_record()], client_timing(), model="tiny", requested_prompt_tokens=900)
    assert [p.name for p in t.phases] == SEED_PHASES
    assert [p.steps for p in t.phases] == ["8-10", "11", "12-15", "23-27", "16-22", "28-30", "34-37", "38-39"]
    ttft = rel(REAL_PROXY["decode_first_byte"])
    assert t.proxy_ttft_ms == near(ttft) and ttft == pytest.approx(164.4, abs=0.01)
    assert t.phases_ms == near(t.proxy_ttft_ms)
    assert abs(t.phases_ms - t.client_ttft_ms) <= 0.05 * t.client_ttft_ms
    assert sum(p.share for p in t.phases) == near(1.0)
    got = {p.name: p.ms for p in t.phases}
    assert got["P queue"] == near(E("registered") - rel(REAL_PROXY["prefill_dispatched"]))
    assert got["P prefill"] == near(P_COMPUTED - E("registered"))
    assert got["P next step"] == near(E("p_finished") - P_COMPUTED)
    # In this run D sent its pull about 100 ms after scheduling it (step 20's first bootstrap query): the
    # request waited there, not in the transfer.
    assert got["wait for D's pull"] == near(E("transfer_start") - E("p_finished")) and got["wait for D's pull"] > 100
    assert got["transfer"] == near(E("notified") - E("transfer_start"))
    assert got["D one-token forward"] == near(ttft - E("first_token_scheduled"))
    assert t.connector_visible and t.notes == []
    assert [(p.start_ms, p.end_ms) for p in t.phases][1] == (near(rel(REAL_PROXY["prefill_dispatched"])), near(E("registered")))


def test_which_phases_cross_clocks() -> None:
    t = assemble(proxy_record(), [connector_record()], client_timing())
    crossing = {p.name: p.clocks for p in t.phases if p.crosses_clocks}
    assert crossing == {"P queue": ["proxy", "P"], "transfer": ["P", "D"], "D one-token forward": ["D", "proxy"]}
    assert not any("different hosts" in n for n in t.notes)
    remote = assemble(proxy_record(), [connector_record()], client_timing(), one_host=False)
    assert any("different hosts" in n and "transfer" in n for n in remote.notes)


def test_events_are_in_time_order_with_seed_steps() -> None:
    t = assemble(proxy_record(), [connector_record()], client_timing())
    times = [e.at for e in t.events]
    assert times == sorted(times)
    steps = {e.name: (e.step, e.lane) for e in t.events}
    assert steps["prefill_dispatched"] == ("9", "proxy")
    assert steps["transfer_start"] == ("28", "P")
    assert steps["notified"] == ("34", "D")
    assert steps["client_done"] == ("43", "client")
    assert "concluded" not in steps  # connector bookkeeping, not a step
    assert t.events[0].name == "client_sent" and t.events[0].t_ms == near(rel(REAL_CLIENT["sent"]))


def test_without_the_end_of_prefill_the_two_p_phases_merge() -> None:
    t = assemble(proxy_record(), [connector_record(p_computed=False)], client_timing())
    names = [p.name for p in t.phases]
    assert names == ["proxy forward", "P queue", "P prefill + P next step", "wait for D's pull", "transfer", "D notified",
                     "D one-token forward"]
    merged = t.phase("P prefill + P next step")
    assert merged.steps == "12-27" and "p_computed not recorded" in merged.note
    assert merged.ms == near(E("p_finished") - E("registered"))
    assert t.phases_ms == near(rel(REAL_PROXY["decode_first_byte"]))


def test_without_the_connector_the_proxy_chain_still_adds_up() -> None:
    t = assemble(proxy_record(), [], client_timing(), connector_note="connector-side steps are not visible: not pdkv's")
    assert [p.name for p in t.phases] == ["proxy forward", "P request (seen by the proxy)", "P answered -> D's first token"]
    assert t.phases_ms == near(rel(REAL_PROXY["decode_first_byte"]))
    assert abs(t.phases_ms - t.client_ttft_ms) <= 0.05 * t.client_ttft_ms
    assert not t.connector_visible and t.transfer is None
    assert t.notes == ["connector-side steps are not visible: not pdkv's"]
    assert all(not p.crosses_clocks for p in t.phases)


def test_a_record_for_another_transfer_is_ignored() -> None:
    other = msgspec.structs.replace(connector_record(), transfer_id="xfer-other")
    t = assemble(proxy_record(), [other], client_timing())
    assert not t.connector_visible and t.transfer is None


def test_clock_skew_is_clamped_and_said() -> None:
    # P's and D's clocks run 40 ms behind the proxy's: P seems to schedule the prompt before the proxy sent it.
    ev = {k: E(k) - 40.0 for k in REAL_CONNECTOR["events"]}
    t = assemble(proxy_record(), [connector_record(ev)], client_timing(), one_host=False)
    assert all(p.ms >= 0 for p in t.phases)
    assert t.phase("P queue").ms == 0.0
    assert any("registered (P) reads" in n and "those clocks disagree" in n for n in t.notes)
    assert t.phases_ms == near(rel(REAL_PROXY["decode_first_byte"]))
    assert all(a.end_ms == b.start_ms for a, b in zip(t.phases, t.phases[1:]))


def test_transfer_facts_match_plan_and_link_floor() -> None:
    t = assemble(proxy_record(), [connector_record()], client_timing(), link_gbps=400)
    plan = size_transfer(TINY, prompt_tokens=REAL_CLIENT["prompt_tokens"], block_size=32, link_gbps=400)
    assert t.transfer.bytes == plan.transfer_bytes == 29 * 32 * 2 * 2 * 2 * 32 * 2
    assert t.transfer.floor_ms == near(plan.floor_ms)
    write_ms = E("transfer_end") - E("transfer_start")
    assert t.transfer.write_ms == near(write_ms) and write_ms == pytest.approx(6.36, abs=0.01)
    assert t.transfer.achieved_gbps == pytest.approx(plan.transfer_bytes * 8 / write_ms / 1e6, rel=1e-3)
    assert link_floor_ms(148_635_648, 400) == pytest.approx(2.97, abs=0.01)  # the seed's ~3 ms


def test_tp_ranks_sum_bytes_and_take_the_slowest() -> None:
    a = connector_record(nbytes=1000)
    slow = dict(connector_record().events)
    slow["transfer_end"] = ms(E("transfer_start") + 9.0)
    b = msgspec.structs.replace(connector_record(nbytes=1000), events=slow)
    t = assemble(proxy_record(), [a, b], client_timing())
    assert t.transfer.bytes == 2000 and t.transfer.descriptors == 4 and t.transfer.workers == 2
    assert t.transfer.write_ms == near(9.0)
    assert any("2 P workers" in n for n in t.notes)


def test_bytes_by_rank_for_p_and_d_of_different_tp() -> None:
    # P TP 2 -> D TP 1: each P worker wrote its half of the heads.
    a, b = (msgspec.structs.replace(connector_record(nbytes=4096), p_rank=r) for r in (1, 0))
    t = assemble(proxy_record(), [a, b], client_timing())
    assert "bytes by TP rank: P0 4,096 B, P1 4,096 B (8,192 B in all)" in t.notes
    # P TP 1 -> D TP 2: one P worker wrote into both D ranks.
    one = msgspec.structs.replace(connector_record(nbytes=8192), d_rank_bytes={"1": 4096, "0": 4096})
    t = assemble(proxy_record(), [one], client_timing())
    assert "bytes by TP rank: P0->D0 4,096 B, P0->D1 4,096 B (8,192 B in all)" in t.notes
    assert t.transfer.bytes == 8192


def test_a_failed_transfer_is_said() -> None:
    rec = msgspec.structs.replace(connector_record(), status="failed", error="transfer failed: peer gone")
    t = assemble(proxy_record(), [rec], client_timing())
    assert any("failed" in n and "peer gone" in n for n in t.notes)


def test_percentile_interpolates() -> None:
    assert percentile([5.0], 90) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == near(2.5)
    assert percentile(list(map(float, range(1, 11))), 90) == near(9.1)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_gives_p50_p90_per_phase() -> None:
    traces = []
    for i in range(10):
        rec = connector_record()
        ev = dict(rec.events)
        for name in ("transfer_end", "reply_sent", "notified", "reported", "first_token_scheduled"):
            ev[name] += i / 1e3  # the KV write takes i ms longer
        ttft = rel(REAL_PROXY["decode_first_byte"]) + i
        traces.append(assemble(proxy_record(decode_first_byte=ttft), [msgspec.structs.replace(rec, events=ev)], client_timing()))
    s = summarize(traces)
    assert s.runs == 10 and [p.name for p in s.phases] == SEED_PHASES
    transfer = next(p for p in s.phases if p.name == "transfer")
    base = E("notified") - E("transfer_start")
    assert transfer.p50_ms == near(base + 4.5) and transfer.p90_ms == near(base + 8.1) and transfer.n == 10
    write = E("transfer_end") - E("transfer_start")
    assert s.transfer_write.min_ms == near(write) and s.transfer_write.max_ms == near(write + 9)
    assert s.proxy_ttft.p50_ms == near(rel(REAL_PROXY["decode_first_byte"]) + 4.5)
    prefill = next(p for p in s.phases if p.name == "P prefill")
    assert prefill.min_ms == prefill.max_ms == near(P_COMPUTED - E("registered"))


def test_one_host() -> None:
    assert one_host("http://127.0.0.1:8000", ["http://127.0.0.1:8100", "http://localhost:8200"])
    assert one_host("http://10.0.0.5:8000", ["http://127.0.0.1:8100", "http://10.0.0.5:8200"])
    assert not one_host("http://10.0.0.5:8000", ["http://10.0.0.6:8100", "http://10.0.0.5:8200"])


def test_early_write_chain_takes_p_forward_done_and_leaves_ps_finish_off_the_path() -> None:
    # A one-token P request: its write started right after the forward, before P sampled and finished.
    events = {"registered": 10.0, "p_forward_done": 20.0, "pull_received": 15.0, "transfer_start": 20.2, "transfer_end": 21.0,
              "reply_sent": 21.2, "notified": 21.5, "p_computed": 23.0, "p_finished": 25.0, "reported": 22.0,
              "first_token_scheduled": 23.5}
    t = assemble(proxy_record(decode_first_byte=28.0), [connector_record(events)], model="tiny")
    got = {p.name: p.ms for p in t.phases}
    assert list(got) == ["proxy forward", "P queue", "P prefill", "wait for D's pull", "transfer", "D notified", "D one-token forward"]
    assert got["P prefill"] == near(10.0) and got["wait for D's pull"] == near(0.2) and got["transfer"] == near(1.3)
    assert got["D notified"] == near(2.0) and got["D one-token forward"] == near(4.5)
    assert t.phases_ms == near(28.0)
    assert not t.notes


def test_on_a_gpu_the_wait_for_ps_forward_there_is_ps_not_the_transfers() -> None:
    # The forward's launch returned at 20.0; the GPU finished it at 23.0 (kv_ready); the write took 0.5 ms.
    events = {"registered": 10.0, "p_forward_done": 20.0, "pull_received": 15.0, "transfer_start": 20.2, "kv_ready": 23.0,
              "transfer_end": 23.5, "reply_sent": 23.7, "notified": 24.0, "p_computed": 25.0, "p_finished": 27.0,
              "reported": 24.5, "first_token_scheduled": 26.0}
    t = assemble(proxy_record(decode_first_byte=30.0), [connector_record(events)], model="tiny")
    got = {p.name: p.ms for p in t.phases}
    assert list(got) == ["proxy forward", "P queue", "P prefill", "wait for D's pull", "P forward on the GPU", "transfer",
                         "D notified", "D one-token forward"]
    assert got["P forward on the GPU"] == near(2.8) and got["transfer"] == near(1.0)
    assert [p.steps for p in t.phases][4:6] == ["15", "28-30"]
    assert t.phases_ms == near(30.0)
    assert t.transfer is not None and t.transfer.write_ms == near(0.5)  # the write alone, not the GPU's tail


def test_a_write_layer_by_layer_runs_beside_ps_forward_and_the_transfer_is_what_is_left_after_it() -> None:
    # socket_write_layers: the first layer went at 12.0, inside the forward that ended at 20.0; the last landed at 20.6.
    events = {"registered": 10.0, "pull_received": 11.0, "transfer_start": 12.0, "p_forward_done": 20.0, "transfer_end": 20.6,
              "reply_sent": 20.8, "notified": 21.0, "p_computed": 23.0, "p_finished": 25.0, "reported": 21.5,
              "first_token_scheduled": 22.5}
    t = assemble(proxy_record(decode_first_byte=27.0), [connector_record(events)], model="tiny")
    got = {p.name: p.ms for p in t.phases}
    assert got["P prefill"] == near(10.0) and got["wait for D's pull"] == near(0.0) and got["transfer"] == near(1.0)
    assert t.phases_ms == near(27.0)
    assert t.transfer is not None and t.transfer.write_ms == near(8.6)  # first layer's start to last layer's end
    assert any("layer by layer" in n for n in t.notes)


def test_the_kv_aware_plan_is_the_first_note() -> None:
    plan = "prefix_hit: P1 holds 640/1000; D0 holds 0/1000; P costs [1000, 360]; D costs [250]"
    routed = msgspec.structs.replace(proxy_record(), route=plan)
    t = assemble(routed, [], client_timing(), connector_note="not visible")
    assert t.notes[0] == "routed by kv-aware: prefix_hit: P1 holds 640/1000; D0 holds 0/1000; P costs [1000, 360]; D costs [250]"
    alone = msgspec.structs.replace(proxy_record(), route="local_prefill: D0 holds 960/1000; D costs [250]", local_prefill="kv_local")
    assert assemble(alone, [], client_timing()).notes[0].endswith("(decode alone, no P)")

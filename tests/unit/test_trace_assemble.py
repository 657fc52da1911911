"""The pure assembly of a trace: the seed's phases from real-shaped records, their sum, clocks, transfer facts, p50/p90."""

from __future__ import annotations

import msgspec
import pytest

from pdkv.geometry import dense_geometry, plan_transfer
from pdkv.protocol import ProxyTiming, TransferTrace
from pdkv.trace.assemble import assemble, link_floor_ms, percentile, summarize
from pdkv.trace.collect import metric_total, one_host
from pdkv.trace.model import ClientTiming

T0 = 1_764_500_000.0
SEED_PHASES = ["proxy forward", "P queue + prefill", "P next step", "wait for D's pull", "transfer", "D notified",
               "D one-token forward"]
TINY = dense_geometry(2, 2, 32, "bfloat16")  # pdkv's tiny model


def near(v: float):
    """Equal to within a microsecond: unix-second floats near 1.76e9 resolve about 0.24 us."""
    return pytest.approx(v, abs=1e-3)


def ms(x: float) -> float:
    return T0 + x / 1e3


def proxy_record(**over: float | None) -> ProxyTiming:
    """The shape of pdkv proxy's record of a streamed 900-token request on the CPU tiny model (offsets in ms)."""
    fields = dict(received=ms(0.0), prefill_dispatched=ms(0.21), decode_dispatched=ms(0.26), prefill_responded=ms(41.9),
                  decode_first_byte=ms(57.4), last_byte=ms(101.3))
    fields.update({k: (ms(v) if v is not None else None) for k, v in over.items()})
    return ProxyTiming(request_id="trace-1", transfer_id="xfer-trace-1", endpoint="/v1/completions", stream=True,
                       prefill_url="http://127.0.0.1:8100", prefill_dp_rank=0, decode_url="http://127.0.0.1:8200",
                       prefill_status=200, status=200, **fields)


def connector_record(events: dict[str, float] | None = None, nbytes: int | None = None, **kw) -> TransferTrace:
    """P's record with D's events merged in, as pdkv's connector serves it (offsets in ms)."""
    ev = {"registered": 3.1, "pull_scheduled": 2.4, "pull_sent": 4.0, "pull_received": 4.3, "p_computed": 38.6,
          "p_finished": 40.2, "transfer_start": 40.5, "transfer_end": 42.7, "reply_sent": 42.9, "notified": 43.2,
          "freed": 44.0, "reported": 45.1, "first_token_scheduled": 48.8, "concluded": 43.3}
    if events is not None:
        ev = events
    plan = plan_transfer(TINY, prompt_tokens=900, block_size=32)
    return TransferTrace(transfer_id="xfer-trace-1", p_req_id="cmpl-trace-1-0", d_req_id="cmpl-trace-1-0", status="sent",
                         bytes=plan.transfer_bytes if nbytes is None else nbytes, descriptors=4,
                         events={k: ms(v) for k, v in ev.items()}, **kw)


def client_timing() -> ClientTiming:
    return ClientTiming(sent=ms(-0.35), first_token=ms(57.9), done=ms(101.8), prompt_tokens=900, completion_tokens=16)


def test_real_shaped_records_give_the_seed_phases_adding_up_to_ttft() -> None:
    t = assemble(proxy_record(), [connector_record()], client_timing(), model="tiny", requested_prompt_tokens=900)
    assert [p.name for p in t.phases] == SEED_PHASES
    assert [p.steps for p in t.phases] == ["8-10", "11-15", "23-27", "16-22", "28-30", "34-37", "38-39"]
    assert t.proxy_ttft_ms == near(57.4)
    assert t.phases_ms == near(t.proxy_ttft_ms)
    assert abs(t.phases_ms - t.client_ttft_ms) <= 0.05 * t.client_ttft_ms
    assert sum(p.share for p in t.phases) == near(1.0)
    got = {p.name: p.ms for p in t.phases}
    assert got["P queue + prefill"] == near(38.6 - 0.21)
    assert got["transfer"] == near(43.2 - 40.5)
    assert got["D one-token forward"] == near(57.4 - 48.8)
    assert t.connector_visible and t.notes == []


def test_which_phases_cross_clocks() -> None:
    t = assemble(proxy_record(), [connector_record()], client_timing())
    crossing = {p.name: p.clocks for p in t.phases if p.crosses_clocks}
    assert crossing == {"P queue + prefill": ["proxy", "P"], "transfer": ["P", "D"], "D one-token forward": ["D", "proxy"]}
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
    assert "concluded" not in steps  # connector bookkeeping, not a seed step
    assert t.events[0].name == "client_sent" and t.events[0].t_ms == near(-0.35)


def test_end_of_prefill_from_vllm_prefill_time_when_the_connector_lacks_it() -> None:
    ev = {k: v for k, v in connector_record().events.items() if k != "p_computed"}
    rec = msgspec.structs.replace(connector_record(), events=ev)
    t = assemble(proxy_record(), [rec], client_timing(), p_prefill_s=0.0352)
    assert [p.name for p in t.phases] == SEED_PHASES
    assert t.phase("P queue + prefill").ms == near(3.1 + 35.2 - 0.21)
    assert t.phase("P next step").ms == near(40.2 - 38.3)
    assert any("vLLM's prefill time" in n for n in t.notes)


def test_a_missing_anchor_merges_its_neighbouring_phases() -> None:
    ev = {k: v for k, v in connector_record().events.items() if k != "p_computed"}
    t = assemble(proxy_record(), [msgspec.structs.replace(connector_record(), events=ev)], client_timing())
    names = [p.name for p in t.phases]
    assert names[1] == "P queue + prefill + P next step"
    assert t.phases[1].steps == "11-27" and "p_computed not recorded" in t.phases[1].note
    assert t.phases_ms == near(57.4)


def test_without_the_connector_the_proxy_chain_still_adds_up() -> None:
    t = assemble(proxy_record(), [], client_timing(), connector_note="connector-side steps are not visible: not pdkv's")
    assert [p.name for p in t.phases] == ["proxy forward", "P request (seen by the proxy)", "P answered -> D's first token"]
    assert t.phases_ms == near(57.4)
    assert not t.connector_visible and t.transfer is None
    assert t.notes == ["connector-side steps are not visible: not pdkv's"]
    assert all(not p.crosses_clocks for p in t.phases)


def test_a_record_for_another_transfer_is_ignored() -> None:
    other = msgspec.structs.replace(connector_record(), transfer_id="xfer-other")
    t = assemble(proxy_record(), [other], client_timing())
    assert not t.connector_visible and t.transfer is None


def test_clock_skew_is_clamped_and_said() -> None:
    # P's clock runs 5 ms behind the proxy's: P seems to schedule the prompt before the proxy sent it.
    ev = {k: v - 5.0 for k, v in {"registered": 3.1, "p_computed": 4.0, "p_finished": 40.2, "transfer_start": 40.5,
                                  "transfer_end": 42.7, "notified": 43.2, "first_token_scheduled": 48.8}.items()}
    t = assemble(proxy_record(), [connector_record(ev)], client_timing(), one_host=False)
    assert all(p.ms >= 0 for p in t.phases)
    assert t.phase("P queue + prefill").ms == 0.0
    assert any("those clocks disagree" in n for n in t.notes)
    assert t.phases_ms == near(57.4)


def test_transfer_facts_match_plan_and_link_floor() -> None:
    t = assemble(proxy_record(), [connector_record()], client_timing(), link_gbps=400)
    plan = plan_transfer(TINY, prompt_tokens=900, block_size=32, link_gbps=400)
    assert t.transfer.bytes == plan.transfer_bytes == 29 * 32 * 2 * 2 * 2 * 32 * 2
    assert t.transfer.floor_ms == near(plan.floor_ms)
    assert t.transfer.write_ms == near(2.2)
    assert t.transfer.achieved_gbps == near(plan.transfer_bytes * 8 / 0.0022 / 1e9)
    assert link_floor_ms(148_635_648, 400) == pytest.approx(2.97, abs=0.01)  # the seed's ~3 ms


def test_tp_ranks_sum_bytes_and_take_the_slowest() -> None:
    a = connector_record(nbytes=1000)
    slow = dict(connector_record().events)
    slow["transfer_end"] = ms(44.0)
    b = msgspec.structs.replace(connector_record(nbytes=1000), events=slow)
    t = assemble(proxy_record(), [a, b], client_timing())
    assert t.transfer.bytes == 2000 and t.transfer.descriptors == 8 and t.transfer.workers == 2
    assert t.transfer.write_ms == near(3.5)
    assert any("2 P workers" in n for n in t.notes)


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
        ev["transfer_end"] += i / 1e3  # KV write 2.2 .. 11.2 ms
        ev["notified"] += i / 1e3
        ev["first_token_scheduled"] += i / 1e3
        traces.append(assemble(proxy_record(decode_first_byte=57.4 + i), [msgspec.structs.replace(rec, events=ev)], client_timing()))
    s = summarize(traces)
    assert s.runs == 10 and [p.name for p in s.phases] == SEED_PHASES
    transfer = next(p for p in s.phases if p.name == "transfer")
    assert transfer.p50_ms == near(2.7 + 4.5) and transfer.p90_ms == near(2.7 + 8.1)
    assert s.transfer_write.min_ms == near(2.2) and s.transfer_write.max_ms == near(11.2)
    assert s.proxy_ttft.p50_ms == near(57.4 + 4.5)


def test_one_host_and_metric_parsing() -> None:
    assert one_host("http://127.0.0.1:8000", ["http://127.0.0.1:8100", "http://localhost:8200"])
    assert one_host("http://10.0.0.5:8000", ["http://127.0.0.1:8100", "http://10.0.0.5:8200"])
    assert not one_host("http://10.0.0.5:8000", ["http://10.0.0.6:8100", "http://10.0.0.5:8200"])
    text = ('# TYPE vllm:request_prefill_time_seconds histogram\n'
            'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3"} 2\n'
            'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 0.25\n'
            'vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 2.0\n'
            'vllm:request_prefill_time_seconds_sum{engine="1",model_name="tiny"} 0.5\n'
            'vllm:request_prefill_time_seconds_count{engine="1",model_name="tiny"} 1.0\n')
    assert metric_total(text, "vllm:request_prefill_time_seconds") == (0.75, 3.0)
    assert metric_total(text, "vllm:time_to_first_token_seconds") is None

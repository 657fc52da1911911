"""Every numeric field on every wire pdkv decodes is bounded: an out-of-range value fails decoding
with a message naming the field, and an edge value inside the bound still decodes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pdkv.bench.control import Checksum, Ready, Refill, Reply, Request, Setup
from pdkv.wire import (
    Announce,
    DeregisterResponse,
    HealthResponse,
    IpcAllocation,
    IpcExport,
    IpcRegion,
    PullReply,
    PullRequest,
    PullStatus,
    Region,
    RegisterRequest,
    StatsQuery,
    StatsReply,
    TraceReport,
    TransferTrace,
    decode_reply,
    decode_request,
)
from pdkv.bounds import MAX_N_SEQUENCES, MAX_RANK, MAX_WAIT_S
from pdkv.proxy_api import CompletionFields, ProxyTiming

NAN, INF = float("nan"), float("inf")
TOP = 2**64  # one past the largest address


def raw(msg: msgspec.Struct) -> Any:
    return msgspec.to_builtins(msg, builtin_types=(bytes,))


def refused(decode, data: Any, needle: str) -> str:
    """Decode `data` and expect a ValidationError whose message holds `needle`; return the message."""
    with pytest.raises(msgspec.ValidationError) as info:
        decode(data)
    message = str(info.value)
    assert needle in message, message
    assert "\n" not in message
    return message


# --- bootstrap --------------------------------------------------------------

REGISTER = {"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://127.0.0.1:5000"}


def decode_register(body: dict) -> RegisterRequest:
    return msgspec.json.decode(msgspec.json.encode(body), type=RegisterRequest)


@pytest.mark.parametrize("field", ["dp_rank", "tp_rank", "pp_rank"])
@pytest.mark.parametrize("value", [2**70, MAX_RANK, -1, True, 1.0, "1", None], ids=repr)
def test_register_ranks_outside_0_to_max_rank_are_refused(field, value):
    refused(decode_register, {**REGISTER, field: value}, f"$.{field}")


@pytest.mark.parametrize("field", ["dp_rank", "tp_rank", "pp_rank"])
def test_register_ranks_at_the_edge_decode(field):
    assert getattr(decode_register({**REGISTER, field: MAX_RANK - 1}), field) == MAX_RANK - 1


def test_bootstrap_answers_refuse_negative_counts():
    refused(lambda b: msgspec.json.decode(b, type=DeregisterResponse), b'{"status": "ok", "removed": -1}', "$.removed")
    refused(lambda b: msgspec.json.decode(b, type=HealthResponse), b'{"status": "ok", "engines": 0, "workers": -3}', "$.workers")


# --- side channel -----------------------------------------------------------

PULL = PullRequest(transfer_id="xfer-1", d_req_id="d1", session="127.0.0.1:1234", tp_rank=0, tp_size=1, block_ids=[0, 1, 2])
ANNOUNCE = Announce(session="127.0.0.1:1234", tp_rank=0, tp_size=1, regions=[Region(4096, 256, 10)])


def pull_frame(**changes: Any) -> bytes:
    body = raw(PULL)
    body.update(changes)
    return msgspec.msgpack.encode(body)


def announce_frame(**changes: Any) -> bytes:
    body = raw(ANNOUNCE)
    body.update(changes)
    return msgspec.msgpack.encode(body)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        (dict(tp_rank=MAX_RANK), "$.tp_rank"),
        (dict(tp_rank=-1), "$.tp_rank"),
        (dict(tp_size=0), "$.tp_size"),
        (dict(tp_size=MAX_RANK + 1), "$.tp_size"),
        (dict(block_ids=[0, 2**31]), "$.block_ids[1]"),
        (dict(block_ids=[-5]), "$.block_ids[0]"),
        (dict(first_block=-1), "$.first_block"),
        (dict(first_block=2**31), "$.first_block"),
        (dict(binding="XYZ"), "$.binding"),
        (dict(binding="a" * 65), "$.binding"),
        (dict(tp_rank=True), "$.tp_rank"),
        (dict(first_block=1.0), "$.first_block"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_pull_requests_out_of_range_fail_decoding(changes, needle):
    refused(decode_request, pull_frame(**changes), needle)


def test_pull_request_edges_decode():
    msg = decode_request(pull_frame(tp_rank=MAX_RANK - 1, tp_size=MAX_RANK, block_ids=[2**31 - 1], first_block=2**31 - 1))
    assert msg.tp_rank == MAX_RANK - 1 and msg.block_ids == [2**31 - 1]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        (dict(regions=[[-1, 256, 10]]), "$.regions[0]"),
        (dict(regions=[[4096, 0, 10]]), "$.regions[0]"),
        (dict(regions=[[4096, 256, 0]]), "$.regions[0]"),
        (dict(regions=[[4096, 256, 2**31 + 1]]), "$.regions[0]"),
        (dict(regions=[[TOP - 256, 256, 2]]), "ends past 2**64"),
        (dict(tp_size=0), "$.tp_size"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_announcements_out_of_range_fail_decoding(changes, needle):
    refused(decode_request, announce_frame(**changes), needle)


def test_announcement_edges_decode():
    msg = decode_request(announce_frame(regions=[[TOP - 512, 256, 2]]))
    assert msg.regions == [Region(TOP - 512, 256, 2)]


@pytest.mark.parametrize(
    ("msg", "changes", "needle"),
    [
        (TraceReport(transfer_id="x", events={"a": 1.0}), dict(events={"a": NAN}), "$.events[...]"),
        (TraceReport(transfer_id="x", events={"a": 1.0}), dict(events={"a": -1.0}), "$.events[...]"),
        (TraceReport(transfer_id="x", events={"a": 1.0}), dict(events={"a": INF}), "$.events[...]"),
        (TraceReport(transfer_id="x", events={}), dict(first_step_tokens=-1), "$.first_step_tokens"),
        (StatsQuery(), dict(since=NAN), "$.since"),
        (StatsQuery(), dict(since=-1.0), "$.since"),
        (StatsQuery(), dict(limit=0), "$.limit"),
        (StatsQuery(), dict(limit=2**40), "$.limit"),
    ],
)
def test_side_channel_requests_out_of_range_fail_decoding(msg, changes, needle):
    body = raw(msg)
    body.update(changes)
    refused(decode_request, msgspec.msgpack.encode(body), needle)


REPLY = PullReply(transfer_id="x", d_req_id="d", status=PullStatus.PENDING)


@pytest.mark.parametrize(
    ("msg", "changes", "needle"),
    [
        (REPLY, dict(bytes=-1), "$.bytes"),
        (REPLY, dict(bytes=2**63), "$.bytes"),
        (REPLY, dict(descriptors=-1), "$.descriptors"),
        (REPLY, dict(wait_bound_s=INF), "$.wait_bound_s"),
        (REPLY, dict(wait_bound_s=-0.5), "$.wait_bound_s"),
        (REPLY, dict(wait_bound_s=MAX_WAIT_S * 2), "$.wait_bound_s"),
        (REPLY, dict(status=7), "$.status"),
        (StatsReply(engine_id="e", tp_rank=0, traces=[], metrics=""), dict(tp_rank=MAX_RANK), "$.tp_rank"),
        (StatsReply(engine_id="e", tp_rank=0, traces=[TransferTrace(transfer_id="x")], metrics=""),
         dict(traces=[{"transfer_id": "x", "bytes": -1}]), "$.traces[0].bytes"),
        (StatsReply(engine_id="e", tp_rank=0, traces=[TransferTrace(transfer_id="x")], metrics=""),
         dict(traces=[{"transfer_id": "x", "events": {"e": NAN}}]), "$.traces[0].events[...]"),
    ],
)
def test_side_channel_replies_out_of_range_fail_decoding(msg, changes, needle):
    body = raw(msg)
    body.update(changes)
    refused(decode_reply, msgspec.msgpack.encode(body), needle)


IPC = IpcExport("host/boot", 42, 1, "GPU-x", [IpcAllocation(b"\x01" * 64, 0x1000, 1 << 20)], [IpcRegion(0, 0x2000, 4096)], 1234)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        (dict(pid=0), "$.ipc.pid"),
        (dict(pid=2**40), "$.ipc.pid"),
        (dict(device=-1), "$.ipc.device"),
        (dict(regions=[[1, 0x2000, 4096]]), "alloc is 1"),  # one allocation only
        (dict(regions=[[-1, 0x2000, 4096]]), "$.ipc.regions[0][0]"),
        (dict(regions=[[0, 0x2000, 0]]), "$.ipc.regions[0][2]"),
        (dict(regions=[[0, TOP - 16, 4096]]), "ends past 2**64"),
        (dict(allocations=[[b"\x01" * 64, TOP - 16, 1 << 20]]), "ends past 2**64"),
        (dict(allocations=[[b"\x01" * 64, 0x1000, 0]]), "$.ipc.allocations[0][2]"),
        (dict(start_time=-1), "$.ipc.start_time"),
        # an allocation shared by file descriptor needs where to fetch it and a whole token
        (dict(allocations=[[b"", 0x1000, 1 << 20, True]]), "need fd_server"),
        (dict(allocations=[[b"", 0x1000, 1 << 20, True]], fd_server="pdkv-fds-1-x", fd_token=b"\x01" * 8), "32-byte fd_token"),
        (dict(fd_token=b"\x01" * 33), "$.ipc.fd_token"),
        (dict(fd_server="x" * 101), "$.ipc.fd_server"),
    ],
)
def test_ipc_exports_out_of_range_fail_decoding(changes, needle):
    body = raw(ANNOUNCE)
    ipc = raw(IPC)
    ipc.update(changes)
    body["ipc"] = ipc
    refused(decode_request, msgspec.msgpack.encode(body), needle)


def test_ipc_export_round_trips():
    assert decode_request(msgspec.msgpack.encode({**raw(ANNOUNCE), "ipc": raw(IPC)})).ipc == IPC
    shared = IpcExport("host/boot", 42, 1, "GPU-x", [IpcAllocation(b"", 0x1000, 1 << 20, fd=True)], [IpcRegion(0, 0x2000, 4096)], 1234,
                       fd_server="pdkv-fds-42-0123456789abcdef", fd_token=b"\x07" * 32)
    assert decode_request(msgspec.msgpack.encode({**raw(ANNOUNCE), "ipc": raw(shared)})).ipc == shared


def test_an_ipc_export_of_an_older_pdkv_decodes_as_cuda_ipc_handles():
    """Exports without the descriptor fields (pdkv before vLLM 0.34 support) still decode: handles, no server."""
    ipc = raw(IPC)
    ipc["allocations"] = [a[:3] for a in ipc["allocations"]]
    del ipc["fd_server"], ipc["fd_token"]
    decoded = decode_request(msgspec.msgpack.encode({**raw(ANNOUNCE), "ipc": ipc})).ipc
    assert decoded == IPC and not decoded.allocations[0].fd and decoded.fd_server == ""


# --- bench control ------------------------------------------------------------


def bench_request(body: dict) -> Any:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=Request)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"op": "setup", "layers": 0, "block_len": 4096, "num_blocks": 4, "seed": 1}, "$.layers"),
        ({"op": "setup", "layers": 5000, "block_len": 4096, "num_blocks": 4, "seed": 1}, "$.layers"),
        ({"op": "setup", "layers": 2, "block_len": 0, "num_blocks": 4, "seed": 1}, "$.block_len"),
        ({"op": "setup", "layers": 2, "block_len": 4096, "num_blocks": 0, "seed": 1}, "$.num_blocks"),
        ({"op": "setup", "layers": 2, "block_len": 4096, "num_blocks": 2**40, "seed": 1}, "$.num_blocks"),
        ({"op": "setup", "layers": 2, "block_len": 4096, "num_blocks": 4, "seed": -1}, "$.seed"),
        ({"op": "setup", "layers": True, "block_len": 4096, "num_blocks": 4, "seed": 1}, "$.layers"),
        ({"op": "refill", "seed": 2**32}, "$.seed"),
        ({"op": "checksum", "ranges": [[-1, 16]]}, "$.ranges[0][0]"),
        ({"op": "checksum", "ranges": [[4096, 0]]}, "$.ranges[0][1]"),
        ({"op": "checksum", "ranges": [[0, 16], [TOP - 8, 16]]}, "checksum ranges[1] ends past 2**64"),
    ],
)
def test_bench_requests_out_of_range_fail_decoding(body, needle):
    refused(bench_request, body, needle)


def test_bench_requests_in_range_decode():
    largest = {"op": "setup", "layers": 4096, "block_len": 1, "num_blocks": 2**31, "seed": 2**32 - 1}
    assert bench_request(largest) == Setup(4096, 1, 2**31, 2**32 - 1)
    assert bench_request({"op": "refill", "seed": 0}) == Refill(0)
    assert bench_request({"op": "checksum", "ranges": [[TOP - 16, 16]]}) == Checksum([(TOP - 16, 16)])


def test_bench_ready_reply_regions_are_bounded():
    ready = Ready("127.0.0.1:1", [Region(4096, 256, 4)], "cpu", "tcp")
    body = raw(ready)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=Reply) == ready
    body["regions"] = [[4096, 256, 0]]
    refused(lambda b: msgspec.msgpack.decode(msgspec.msgpack.encode(b), type=Reply), body, "$.regions[0][2]")


# --- proxy --------------------------------------------------------------------


def completion(body: dict) -> CompletionFields:
    return msgspec.convert(body, CompletionFields)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"stream": "yes"}, "$.stream"),
        ({"stream": 1}, "$.stream"),
        ({"n": 0}, "$.n"),
        ({"n": True}, "$.n"),
        ({"n": 1.5}, "$.n"),
        ({"n": MAX_N_SEQUENCES + 1}, "$.n"),
        ({"n": 2**70}, "$.n"),
    ],
)
def test_completion_fields_the_proxy_reads_are_checked(body, needle):
    refused(completion, {"prompt": "hi", **body}, needle)


def test_completion_fields_accept_nulls_and_ignore_the_rest():
    assert completion({"prompt": "hi", "stream": None, "n": None, "max_tokens": -3}) == CompletionFields()
    assert completion({"stream": True, "n": MAX_N_SEQUENCES}) == CompletionFields(stream=True, n=MAX_N_SEQUENCES)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [(dict(prefill_dp_rank=2**70), "$.prefill_dp_rank"), (dict(status=42), "$.status"), (dict(received=-1.0), "$.received")],
)
def test_proxy_timing_records_are_bounded(changes, needle):
    body = {"request_id": "r", "transfer_id": "xfer-r", "endpoint": "/v1/completions", **changes}
    refused(lambda b: msgspec.json.decode(msgspec.json.encode(b), type=ProxyTiming), body, needle)

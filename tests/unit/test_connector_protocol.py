"""Side-channel messages, kv_transfer_params and kv_connector_extra_config, decoded strictly."""

from __future__ import annotations

import msgspec
import pytest

from pdkv.connector.config import ParamsError, check_decode_params, classify_params, load_config
from pdkv.connector.checks import announced_share, check_announce, check_pull
from pdkv.wire import Announce, PullReply, PullRequest, PullStatus, Region, Release, StatsQuery, decode_reply, decode_request, encode
from pdkv.errors import ConfigError


def pull(**kw) -> PullRequest:
    base = dict(
        transfer_id="xfer-1",
        d_req_id="d1",
        session="127.0.0.1:1234",
        tp_rank=0,
        tp_size=1,
        block_ids=[0, 1, 2],
    )
    base.update(kw)
    return PullRequest(**base)


def test_requests_round_trip_as_tagged_msgpack():
    for msg in (pull(first_block=2), announce(), Release(transfer_id="x", d_req_id="d"), StatsQuery(since=1.5)):
        assert decode_request(encode(msg)) == msg
    r = PullReply(transfer_id="x", d_req_id="d", status=PullStatus.DONE, bytes=10, descriptors=2)
    assert decode_reply(encode(r)) == r


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1garbage",  # not msgpack
        msgspec.msgpack.encode({"type": "nope"}),  # unknown tag
        msgspec.msgpack.encode({"type": "pull", "transfer_id": 5}),  # wrong type, missing fields
        msgspec.msgpack.encode([1, 2, 3]),
    ],
)
def test_malformed_frames_raise_msgspec_errors(frame):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_request(frame)


def test_negative_block_ids_fail_decoding():
    raw = msgspec.to_builtins(pull())
    raw["type"] = "pull"
    raw["block_ids"] = [0, -5]
    with pytest.raises(msgspec.ValidationError):
        decode_request(msgspec.msgpack.encode(raw))


REGIONS = [Region(0, 256, 10), Region(10_000, 256, 10)]


def announce(**kw) -> Announce:
    base = dict(session="127.0.0.1:1234", tp_rank=0, tp_size=1, regions=[Region(4096, 256, 10), Region(8192, 256, 10)])
    base.update(kw)
    return Announce(**base)


def test_check_pull_accepts_matching_geometry():
    assert check_announce(announce(), REGIONS, 0, 1) is None
    assert check_pull(pull(), announce()) is None


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(block_ids=[0, 10]), "outside"),
        (dict(block_ids=[1, 1]), "repeat"),
        (dict(tp_size=2), "announced rank 0 of 1"),
        (dict(tp_rank=1), "decode TP rank 1 of 1"),
    ],
)
def test_check_pull_refuses_what_would_write_outside_or_mismatch(kw, needle):
    why = check_pull(pull(**kw), announce())
    assert why is not None and needle in why


def test_a_pull_for_a_session_that_announced_nothing_is_refused():
    why = check_pull(pull(), None)
    assert why is not None and "has not announced" in why


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(regions=[Region(0, 256, 10)]), "regions"),
        (dict(regions=[Region(0, 128, 10), Region(0, 128, 10)]), "block is 128 B"),
        (dict(tp_size=2), "unequal TP"),
    ],
)
def test_check_announce_refuses_other_layouts(kw, needle):
    why = check_announce(announce(**kw), REGIONS, 0, 1)
    assert why is not None and needle in why


# Unequal TP: a model of 4 KV heads, 64 B per head in a block, two regions (layers).
HEAD = 64


def _regions(heads: int) -> list[Region]:
    return [Region(0, heads * HEAD, 10), Region(100_000, heads * HEAD, 10)]


def test_check_announce_accepts_a_d_of_another_tp_size_holding_its_heads():
    # P TP 1 holds all 4 heads; D rank 1 of TP 2 holds heads 2-3 and announces blocks of 2 heads.
    a = announce(tp_rank=1, tp_size=2, kv_heads=4, regions=_regions(2))
    assert check_announce(a, _regions(4), 0, 1, kv_heads=4) is None
    share = announced_share(a, 0, 1, 4)
    assert share is not None and (share.src_first, share.dst_first, share.count) == (2, 0, 2)
    # P rank 1 of TP 2 (heads 2-3) and a D of TP 1 (all 4): P's heads go to D's heads 2-3.
    a = announce(tp_rank=0, tp_size=1, kv_heads=4, regions=_regions(4))
    assert check_announce(a, _regions(2), 1, 2, kv_heads=4) is None
    assert announced_share(a, 1, 2, 4)[:3] == (0, 2, 2)


@pytest.mark.parametrize(
    ("kw", "p_heads", "needle"),
    [
        (dict(tp_size=2, kv_heads=0, regions=_regions(2)), 4, "did not say how many KV heads"),
        (dict(tp_size=2, kv_heads=8, regions=_regions(2)), 4, "decode's model has 8 KV heads, prefill's 4"),
        (dict(tp_size=3, kv_heads=4, regions=_regions(2)), 4, "do not split evenly over TP 3"),
        (dict(tp_size=2, kv_heads=4, regions=_regions(4)), 4, "one head is"),  # D's blocks hold 4 heads' bytes, not 2
        (dict(tp_size=2, kv_heads=4, regions=[Region(0, 101, 10)] * 2), 4, "not 4 (P) or 2 (D) heads of equal size"),
        (dict(tp_size=2, kv_heads=4, regions=_regions(2)[:1]), 4, "regions"),
    ],
)
def test_check_announce_refuses_a_split_that_does_not_fit(kw, p_heads, needle):
    a = announce(tp_rank=1, **kw)
    why = check_announce(a, _regions(p_heads), 0, 1, kv_heads=4)
    assert why is not None and needle in why, why


def test_tp_sizes_that_do_not_divide_each_other_are_refused():
    why = check_announce(announce(tp_rank=0, tp_size=3, kv_heads=12, regions=_regions(4)), _regions(6), 0, 2, kv_heads=12)
    assert why is not None and "do not divide each other" in why


def test_a_prefill_rank_that_holds_none_of_ds_heads_refuses_it():
    # P TP 2 (heads 0-1, 2-3), D TP 4 rank 0 (head 0): P rank 1 has nothing for it.
    why = check_announce(announce(tp_rank=0, tp_size=4, kv_heads=4, regions=_regions(1)), _regions(2), 1, 2, kv_heads=4)
    assert why is not None and "takes no KV heads from prefill TP rank 1" in why


def test_a_prefill_without_the_head_count_refuses_unequal_tp():
    why = check_announce(announce(tp_rank=1, tp_size=2, kv_heads=4, regions=_regions(2)), _regions(4), 0, 1)
    assert why is not None and "prefill did not say" in why


def test_params_classify_as_the_proxy_writes_them():
    role, p = classify_params({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-a"})
    assert role == "prefill" and p.transfer_id == "xfer-a"
    role, d = classify_params(
        {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": "http://127.0.0.1:8998",
            "remote_engine_id": "e",
            "transfer_id": "xfer-a",
        }
    )
    assert role == "decode" and d.remote_engine_id == "e"
    check_decode_params(d)
    assert classify_params(None) == ("none", None)
    assert classify_params({"do_remote_decode": False}) == ("none", None)


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True, "transfer_id": "x"},  # no bootstrap, no engine
        {"do_remote_prefill": True, "do_remote_decode": True, "transfer_id": "x"},
        {"do_remote_decode": True},  # no transfer_id
        {"do_remote_decode": True, "transfer_id": 7},
    ],
)
def test_bad_params_raise_a_clear_error(params):
    with pytest.raises(ParamsError):
        classify_params(params)


def test_decode_params_need_an_http_bootstrap():
    _, d = classify_params(
        {"do_remote_prefill": True, "remote_bootstrap_addr": "127.0.0.1:8998", "remote_engine_id": "e", "transfer_id": "x"}
    )
    with pytest.raises(ParamsError, match="http"):
        check_decode_params(d)


def test_config_defaults_and_validation():
    c = load_config({"mooncake_protocol": "tcp", "device_name": "", "unknown_wait_s": "3", "vllm_key": 1})
    assert c.unknown_wait_s == 3.0 and c.transport == "tcp"
    with pytest.raises(ConfigError, match="mooncake_protocol must be one of"):
        load_config({"mooncake_protocol": "carrier-pigeon"})
    assert c.hold_wait_ms == 20.0 and load_config({"hold_wait_ms": 0}).hold_wait_ms == 0
    for bad in (-1, 1001):
        with pytest.raises(ConfigError, match="hold_wait_ms must be 0..1000"):
            load_config({"hold_wait_ms": bad})


def test_config_transport_is_read_from_either_key():
    assert load_config({}).transport == "tcp"
    assert load_config({"mooncake_protocol": "cma"}).transport == "cma"
    assert load_config({"transport": "ipc"}).transport == "ipc"
    assert load_config({"transport": "rdma", "mooncake_protocol": "rdma"}).transport == "rdma"
    with pytest.raises(ConfigError, match="mooncake_protocol='tcp' and transport='ipc'"):
        load_config({"mooncake_protocol": "tcp", "transport": "ipc"})
    with pytest.raises(ConfigError, match="transport must be one of"):
        load_config({"transport": "carrier-pigeon"})
    with pytest.raises(ConfigError, match="heartbeat_s"):
        load_config({"heartbeat_s": 5, "liveness_s": 2})


def test_config_socket_settings():
    c = load_config({"mooncake_protocol": "socket", "socket_port": "7000", "socket_connections": 3})
    assert (c.transport, c.socket_port, c.socket_connections) == ("socket", 7000, 3)
    assert load_config({}).socket_connections == 0  # the worker's cores, at most 4 (SocketTransport decides)
    assert load_config({}).socket_buffer_bytes is None  # the transport's default
    assert load_config({"socket_buffer_bytes": 0}).socket_buffer_bytes == 0  # the kernel's autotuning
    assert load_config({"socket_buffer_bytes": "1048576"}).socket_buffer_bytes == 1 << 20
    for key, bad, needle in (("socket_port", 65000, "0..64511"), ("socket_connections", 65, "0..64"), ("socket_connections", -1, "0..64"),
                             ("socket_buffer_bytes", 100, r"0 \(the kernel.s autotuning\) or 4096"), ("socket_buffer_bytes", -1, "4096..")):
        with pytest.raises(ConfigError, match=needle):
            load_config({key: bad})


def test_config_writing_layer_by_layer_is_on_by_default_on_a_gpu_and_only_for_the_socket_transport():
    unset = load_config({"mooncake_protocol": "socket"})
    assert unset.socket_write_layers is None and unset.writes_layers(on_gpu=True) and not unset.writes_layers(on_gpu=False)
    assert not load_config({"transport": "socket", "socket_write_layers": False}).writes_layers(on_gpu=True)
    assert load_config({"transport": "socket", "socket_write_layers": True}).writes_layers(on_gpu=False)
    assert not any(load_config({"mooncake_protocol": t}).writes_layers(on_gpu=True) for t in ("tcp", "rdma", "ipc", "cma"))
    assert load_config({"transport": "socket", "socket_write_layers": "true"}).socket_write_layers is True
    assert load_config({"mooncake_protocol": "tcp", "socket_write_layers": False}).socket_write_layers is False
    for transport in ("tcp", "rdma", "ipc", "cma"):
        with pytest.raises(ConfigError, match=f"socket_write_layers needs the socket transport, not {transport}") as err:
            load_config({"mooncake_protocol": transport, "socket_write_layers": True})
        assert "docs/bench.md" in (err.value.hint or "")
    with pytest.raises(ConfigError, match="socket_write_layers"):
        load_config({"mooncake_protocol": "socket", "socket_write_layers": "sometimes"})


def test_config_the_send_process_is_on_by_default_for_gpu_kv_over_socket_and_refused_with_other_transports():
    unset = load_config({"mooncake_protocol": "socket"})
    assert unset.socket_send_process is None and unset.sends_from_process(on_gpu=True) and not unset.sends_from_process(on_gpu=False)
    assert not load_config({"transport": "socket", "socket_send_process": False}).sends_from_process(on_gpu=True)
    assert load_config({"transport": "socket", "socket_send_process": "true"}).socket_send_process is True
    assert not any(load_config({"mooncake_protocol": t}).sends_from_process(on_gpu=True) for t in ("tcp", "rdma", "ipc", "cma"))
    for transport in ("tcp", "ipc"):
        with pytest.raises(ConfigError, match=f"socket_send_process needs the socket transport, not {transport}"):
            load_config({"mooncake_protocol": transport, "socket_send_process": True})
    with pytest.raises(ConfigError, match="socket_send_process"):
        load_config({"mooncake_protocol": "socket", "socket_send_process": "sometimes"})


def test_config_layer_groups_default_to_six_writes_a_forward_and_out_of_range_is_refused():
    assert load_config({"transport": "socket", "socket_write_layers": True}).socket_layer_groups == 6
    assert load_config({"transport": "socket", "socket_write_layers": True, "socket_layer_groups": "36"}).socket_layer_groups == 36
    for bad in (0, -1, 1025):
        with pytest.raises(ConfigError, match=f"socket_layer_groups must be 1..1024, got {bad}"):
            load_config({"transport": "socket", "socket_write_layers": True, "socket_layer_groups": bad})

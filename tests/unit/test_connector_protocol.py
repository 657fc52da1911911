"""Side-channel messages, kv_transfer_params and kv_connector_extra_config, decoded strictly."""

from __future__ import annotations

import msgspec
import pytest

from pdkv.connector.config import ParamsError, check_decode_params, classify_params, load_config
from pdkv.connector.checks import check_announce, check_pull
from pdkv.side_channel import decode_reply, decode_request, encode
from pdkv.errors import ConfigError
from pdkv.protocol import Announce, PullReply, PullRequest, PullStatus, Region, Release, StatsQuery


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
    assert check_pull(pull(), announce(), 0, 1) is None


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(block_ids=[0, 10]), "outside"),
        (dict(block_ids=[1, 1]), "repeat"),
        (dict(tp_size=2), "unequal TP"),
        (dict(tp_rank=1), "TP rank"),
    ],
)
def test_check_pull_refuses_what_would_write_outside_or_mismatch(kw, needle):
    why = check_pull(pull(**kw), announce(), 0, 1)
    assert why is not None and needle in why


def test_a_pull_for_a_session_that_announced_nothing_is_refused():
    why = check_pull(pull(), None, 0, 1)
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

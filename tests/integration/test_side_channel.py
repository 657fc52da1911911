"""P's side-channel listener against malformed and hostile messages, over a real ZMQ socket.

Each bad message gets an error reply or is dropped and logged; the listener
keeps serving, and no byte of D's memory outside the named blocks changes.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq
from support.kv_pair import KVHarness, wait_freed

from pdkv.connector.send_table import SendLimits
from pdkv.wire import Announce, ErrorReply, PullReply, PullRequest, PullStatus, Region, StatsQuery, StatsReply, decode_reply, encode

BLOCKS, BLOCK_LEN = 8, 256


@pytest.fixture
def world(kv: KVHarness) -> Iterator[dict]:
    p = kv.side(fill=1, shape=(2, BLOCKS, BLOCK_LEN))
    d = kv.side(fill=None, shape=(2, BLOCKS, BLOCK_LEN))
    sender = kv.sender(p, engine_id="e", limits=SendLimits(unknown_wait_s=0.5), heartbeat_s=0.1)
    session = d.transport.session_address
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(sender.address)
    sock.send(encode(Announce(session=session, tp_rank=0, tp_size=1, regions=d.regions)))
    try:
        yield {"sender": sender, "sock": sock, "d_mem": d.mem, "d_regions": d.regions, "session": session}
    finally:
        sock.close()
        ctx.term()


def pull(w: dict, tid: str, blocks: list[int], **kw) -> PullRequest:
    return PullRequest(transfer_id=tid, d_req_id="d-" + tid, session=w["session"], tp_rank=0, tp_size=1, block_ids=blocks, **kw)


def announce(w: dict, regions: list[Region] | None = None) -> Announce:
    return Announce(session=w["session"], tp_rank=0, tp_size=1, regions=w["d_regions"] if regions is None else regions)


def recv_final(sock: zmq.Socket):
    while True:
        msg = decode_reply(sock.recv())
        if not (isinstance(msg, PullReply) and msg.status == PullStatus.PENDING):
            return msg


def assert_listener_alive(w: dict) -> None:
    w["sender"].apply_step(ready={"p-ok": ("ok", [1])})
    w["sock"].send(encode(pull(w, "ok", [6])))
    reply = recv_final(w["sock"])
    assert isinstance(reply, PullReply) and reply.status == PullStatus.DONE, reply
    assert (w["d_mem"][:, 6] != 0).any()


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1\xc1not msgpack",
        msgspec.msgpack.encode({"type": "pull", "transfer_id": 12}),
        msgspec.msgpack.encode({"type": "launch_missiles"}),
        msgspec.msgpack.encode("just a string"),
        b"",
    ],
    ids=["bad-msgpack", "wrong-types", "unknown-tag", "not-a-struct", "empty"],
)
def test_malformed_frames_get_an_error_reply(world, frame):
    world["sock"].send(frame)
    reply = decode_reply(world["sock"].recv())
    assert isinstance(reply, ErrorReply) and "malformed" in reply.error
    assert_listener_alive(world)
    assert not world["d_mem"][:, :6].any()


def test_multi_frame_messages_are_dropped(world):
    world["sock"].send_multipart([b"a", b"b", b"c"])
    assert_listener_alive(world)
    assert world["sender"].server.dropped >= 1


def test_out_of_range_block_ids_are_refused_and_nothing_is_written(world):
    world["sender"].apply_step(ready={"p1": ("x1", [0, 1])})
    world["sock"].send(encode(pull(world, "x1", [7, BLOCKS])))  # one past the end
    reply = recv_final(world["sock"])
    assert isinstance(reply, PullReply) and reply.status == PullStatus.ERROR and "outside" in reply.error
    # A region claiming more blocks than the peer registered cannot stretch the write either:
    # its length must match P's block length, and P checks its own ids too.
    doubled = [Region(r.base, r.block_len * 2, r.num_blocks) for r in world["d_regions"]]
    world["sock"].send(encode(announce(world, doubled)))
    refused = decode_reply(world["sock"].recv())
    assert isinstance(refused, ErrorReply) and "block is" in refused.error
    world["sock"].send(encode(pull(world, "x1", [0])))
    reply = recv_final(world["sock"])
    assert reply.status == PullStatus.ERROR and "were refused" in reply.error  # not the earlier regions either
    assert not world["d_mem"].any()
    world["sock"].send(encode(announce(world)))
    assert_listener_alive(world)


def test_a_pull_for_a_session_that_never_announced_is_refused(world):
    world["sender"].apply_step(ready={"p1": ("x1", [0, 1])})
    world["sock"].send(encode(PullRequest(transfer_id="x1", d_req_id="d", session="127.0.0.1:1", tp_rank=0, tp_size=1,
                                          block_ids=[0])))
    reply = recv_final(world["sock"])
    assert reply.status == PullStatus.ERROR and "has not announced" in reply.error
    assert not world["d_mem"].any()


def test_more_blocks_than_p_holds_is_an_error(world):
    world["sender"].apply_step(ready={"p1": ("x1", [0, 1])})
    world["sock"].send(encode(pull(world, "x1", [2, 3, 4])))
    reply = recv_final(world["sock"])
    assert reply.status == PullStatus.ERROR and "holds in 2" in reply.error
    assert not world["d_mem"].any()
    wait_freed(world["sender"], {"p1"}, timeout=2)  # a failed send still frees P's blocks


def test_unknown_transfer_id_is_answered_after_the_wait_bound(world):
    world["sock"].send(encode(pull(world, "nobody", [0])))
    first = decode_reply(world["sock"].recv())
    assert isinstance(first, PullReply) and first.status == PullStatus.PENDING and 0 < first.wait_bound_s <= 0.5
    reply = recv_final(world["sock"])
    assert reply.status == PullStatus.ERROR and "never saw" in reply.error
    assert_listener_alive(world)


def test_stats_query_returns_traces_and_metrics(world):
    assert_listener_alive(world)
    world["sock"].send(encode(StatsQuery()))
    reply = decode_reply(world["sock"].recv())
    assert isinstance(reply, StatsReply) and reply.engine_id == "e"
    [t] = [t for t in reply.traces if t.transfer_id == "ok"]
    assert t.status == "sent" and t.bytes == 2 * BLOCK_LEN and t.descriptors == 2
    assert 'pdkv_connector_transfers_total{outcome="sent",role="prefill"} 1.0\n' in reply.metrics


def test_side_channel_port_is_read_and_bounded():
    from pdkv.connector.config import load_config
    from pdkv.errors import ConfigError

    assert load_config({"side_channel_port": 5600}).side_channel_port == 5600
    with pytest.raises(ConfigError, match="side_channel_port"):
        load_config({"side_channel_port": 70000})

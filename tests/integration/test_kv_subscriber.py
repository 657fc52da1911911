"""The proxy's KV event subscriber against vLLM's own ZmqEventPublisher over real ZMQ sockets on loopback.

vLLM's publisher class runs here without an engine (its thread, PUB socket,
replay ROUTER and buffer are the engine's own code); tests/e2e/test_kv_events.py
does the same against a running engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdkv.proxy.kv.index import KvIndex
from pdkv.proxy.kv.subscriber import EventSource, KvEventSubscriber, StreamObserver
from pdkv.proxy.kv.prefix import block_keys
from support.ports import free_port
from support.waiting import wait_for

kv_events = pytest.importorskip("vllm.distributed.kv_events")
BS = 4
ENGINE = "http://127.0.0.1:1"


class Recorder(StreamObserver):
    def __init__(self) -> None:
        self.replays: list[str] = []
        self.modes: list[tuple[bool, str]] = []
        self.errors = 0

    def replay(self, engine: str, reason: str) -> None:
        self.replays.append(reason)

    def mode(self, engine: str, approximate: bool, reason: str) -> None:
        self.modes.append((approximate, reason))

    def decode_error(self, engine: str) -> None:
        self.errors += 1


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int]):
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, lora_id=None,
                                 medium="GPU", lora_name=None)


def batch(*events):
    return kv_events.KVEventBatch(ts=time.time(), events=list(events))


@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


def publisher(ports: tuple[int, int]):
    return kv_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}", buffer_steps=100)


@pytest.fixture
def world(ports) -> Iterator[tuple]:
    pub = publisher(ports)
    index, rec = KvIndex(), Recorder()
    src = EventSource(ENGINE, f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
    sub = KvEventSubscriber(index, [src], observer=rec, replay_timeout_s=2.0).start()
    try:
        yield pub, index, rec, sub
    finally:
        sub.close()
        pub.shutdown()


TOKENS = list(range(1, 17))  # 4 blocks


def test_events_published_before_the_subscriber_joined_come_by_replay(ports):
    pub = publisher(ports)
    try:
        pub.publish(batch(stored([b"a", b"b"], None, TOKENS[:8])))
        time.sleep(0.3)  # published to nobody: only the replay buffer has it
        index = KvIndex()
        src = EventSource(ENGINE, f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
        with KvEventSubscriber(index, [src], observer=Recorder()):
            wait_for(lambda: index.hits(ENGINE, block_keys(TOKENS, BS), time.monotonic()).reported == 2)
    finally:
        pub.shutdown()


def test_live_events_gap_replay_and_removal(world):
    pub, index, rec, sub = world
    keys = block_keys(TOKENS, BS)
    wait_for(lambda: "connected" in rec.replays)
    pub.publish(batch(stored([b"a", b"b"], None, TOKENS[:8])))
    wait_for(lambda: index.hits(ENGINE, keys, time.monotonic()).reported == 2)
    wait_for(lambda: "settle" in rec.replays and sub.replays_ended == 2)  # both replays of the connection are over
    # A gap: the subscriber misses one batch (dropped on its side), sees the next, and replays the missing one.
    n = sub.batches
    sub_drop = {"left": 1}
    original = sub._on_live

    def dropping(st, seq, payload):
        if sub_drop["left"]:
            sub_drop["left"] -= 1
            return
        original(st, seq, payload)

    sub._on_live = dropping
    pub.publish(batch(stored([b"c"], b"b", TOKENS[8:12])))
    pub.publish(batch(stored([b"d"], b"c", TOKENS[12:16])))
    wait_for(lambda: index.hits(ENGINE, keys, time.monotonic()).reported == 4)
    assert "gap" in rec.replays and sub.batches == n + 2
    pub.publish(batch(kv_events.BlockRemoved(block_hashes=[b"b"], medium="GPU")))
    wait_for(lambda: index.hits(ENGINE, keys, time.monotonic()).reported == 1)
    pub.publish(batch(kv_events.AllBlocksCleared()))
    wait_for(lambda: index.hits(ENGINE, keys, time.monotonic()).reported == 0)
    assert rec.errors == 0


def test_a_batch_the_slow_joiner_lost_comes_by_the_settle_replay(ports):
    # ZMQ's slow joiner: a batch published after the SUB connected, before the publisher knew of it, and after the
    # connection's replay ran, reaches neither socket. Dropping the first live batch stands for it.
    pub = publisher(ports)
    index, rec = KvIndex(), Recorder()
    src = EventSource(ENGINE, f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
    sub = KvEventSubscriber(index, [src], observer=rec, settle_s=3.0)
    dropped: list[int] = []
    original = sub._on_live
    sub._on_live = lambda st, seq, payload: dropped.append(seq) if not dropped else original(st, seq, payload)
    keys = block_keys(TOKENS, BS)
    try:
        with sub:
            wait_for(lambda: sub.replays_ended == 1)  # the connection's replay: nothing published yet
            pub.publish(batch(stored([b"a", b"b"], None, TOKENS[:8])))
            wait_for(lambda: dropped == [0])
            assert index.hits(ENGINE, keys, time.monotonic()).reported == 0 and "settle" not in rec.replays
            wait_for(lambda: index.hits(ENGINE, keys, time.monotonic()).reported == 2)
            assert rec.replays == ["connected", "settle"]
    finally:
        pub.shutdown()


def test_a_restarted_publisher_is_a_new_stream_without_stale_blocks(ports):
    index, rec = KvIndex(), Recorder()
    src = EventSource(ENGINE, f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
    keys = block_keys(TOKENS, BS)
    pub = publisher(ports)
    with KvEventSubscriber(index, [src], observer=rec):
        try:
            wait_for(lambda: "connected" in rec.replays)
            pub.publish(batch(stored([b"a", b"b", b"c"], None, TOKENS[:12])))
            wait_for(lambda: index.hits(ENGINE, keys, time.monotonic()).reported == 3)
        finally:
            pub.shutdown()
        wait_for(lambda: (True, "disconnected") in rec.modes)
        pub = publisher(ports)  # the same ports, numbered from 0 again, holding other blocks
        try:
            pub.publish(batch(stored([b"x"], None, [9, 9, 9, 9])))
            wait_for(lambda: index.hits(ENGINE, block_keys([9, 9, 9, 9, 9], BS), time.monotonic()).reported == 1)
            assert index.hits(ENGINE, keys, time.monotonic()).blocks == 0
            assert index.sizes()[ENGINE][0] == 1
            assert rec.replays.count("connected") == 2
        finally:
            pub.shutdown()


def test_a_silent_stream_falls_back_to_the_proxys_own_view(ports):
    index, rec = KvIndex(predict_ttl_s=0.5, approximate_ttl_s=60.0), Recorder()
    src = EventSource(ENGINE, f"tcp://127.0.0.1:{ports[0]}", None)  # nobody publishes there
    keys = block_keys(TOKENS, BS)
    with KvEventSubscriber(index, [src], observer=rec, silent_after_s=0.3):
        index.predict(ENGINE, keys, time.monotonic())
        wait_for(lambda: (True, "silent") in rec.modes)
        assert index.sizes()[ENGINE][2] is True
        index.predict(ENGINE, keys, time.monotonic())
        time.sleep(0.6)  # past predict_ttl_s, within approximate_ttl_s
        assert index.hits(ENGINE, keys, time.monotonic()).predicted == 4


def test_engines_followed_and_unfollowed_at_run_time(ports):
    pub = publisher(ports)
    index, rec = KvIndex(), Recorder()
    keys = block_keys(TOKENS, BS)
    try:
        with KvEventSubscriber(index, [], observer=rec) as sub:
            sub.follow(EventSource(ENGINE, f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}"))
            wait_for(lambda: "connected" in rec.replays)
            pub.publish(batch(stored([b"a"], None, TOKENS[:4])))
            wait_for(lambda: index.hits(ENGINE, keys, time.monotonic()).reported == 1)
            sub.unfollow(ENGINE)
            wait_for(lambda: ENGINE not in index.sizes())
            pub.publish(batch(stored([b"b"], b"a", TOKENS[4:8])))
            time.sleep(0.3)
            assert ENGINE not in index.sizes()
    finally:
        pub.shutdown()

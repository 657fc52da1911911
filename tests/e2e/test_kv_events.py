"""The proxy's KV event subscriber against a running vLLM engine (tiny model, CPU) publishing through --kv-events-config.

One engine serves the module (VLLM_SERVER_DEV_MODE for /reset_prefix_cache);
the last test restarts it on the same event ports. Checked: a prompt's blocks
arrive as events under exactly the keys the proxy computes from /tokenize's
token ids; a gap (a batch the subscriber missed) is filled from the engine's
replay socket; a prefix-cache reset (AllBlocksCleared, published with the
engine's next step) and an engine restart
(a new stream numbered from 0) leave no stale entry.
"""

from __future__ import annotations

import time

import httpx
import pytest

from support.ports import free_port_pair
from support.waiting import wait_for

from pdkv.proxy.kv.index import KvIndex
from pdkv.proxy.kv.subscriber import EventSource, KvEventSubscriber, StreamObserver
from pdkv.proxy.kv.prefix import block_keys
from pdkv.tinymodel import sample_text

pytestmark = pytest.mark.e2e
BLOCK = 32  # the e2e engines' block size


class Recorder(StreamObserver):
    def __init__(self) -> None:
        self.replays: list[str] = []

    def replay(self, engine: str, reason: str) -> None:
        self.replays.append(reason)


@pytest.fixture(scope="module")
def events_port() -> int:
    return free_port_pair()


@pytest.fixture(scope="module")
def engine_args(events_port: int) -> dict:
    return {"role": "none", "omp_bind": "0", "kv_events_port": events_port, "env": {"VLLM_SERVER_DEV_MODE": "1"}, "name": "kv-events"}


@pytest.fixture(scope="module")
def follow(events_port: int):
    index, rec = KvIndex(), Recorder()
    src = EventSource("engine", f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{events_port + 1}")
    sub = KvEventSubscriber(index, [src], observer=rec).start()
    try:
        yield index, rec, sub
    finally:
        sub.close()


def tokens_of(url: str, model: str, prompt: str) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": prompt}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def complete(url: str, model: str, prompt: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}, timeout=120)
    r.raise_for_status()


def reported(index: KvIndex, keys: list[int]) -> int:
    return index.hits("engine", keys, time.monotonic()).reported


def test_a_prompts_blocks_arrive_under_the_proxys_keys(start_vllm, engine_args, follow, tiny_model):
    engine = start_vllm(**engine_args)
    index, rec, _ = follow
    model = str(tiny_model)
    prompt = sample_text(200, seed=11)
    keys = block_keys(tokens_of(engine.url, model, prompt), BLOCK)
    assert len(keys) >= 3
    complete(engine.url, model, prompt)
    wait_for(lambda: reported(index, keys) == len(keys), what="all the prompt's blocks reported")
    assert index.block_size("engine") == BLOCK
    assert "connected" in rec.replays
    # Another prompt sharing the first half: only the shared blocks are hits.
    other = block_keys(tokens_of(engine.url, model, prompt[: len(prompt) // 2] + " " + sample_text(80, seed=12)), BLOCK)
    assert 0 < reported(index, other) < len(other)


def test_a_missed_batch_is_replayed_from_the_engine(start_vllm, engine_args, follow, tiny_model):
    engine = start_vllm(**engine_args)
    index, rec, sub = follow
    model = str(tiny_model)
    dropped = {"left": 1}
    original = sub._on_live

    def drop_one(st, seq, payload):  # the subscriber misses one live batch, as at a full high-water mark
        if dropped["left"]:
            dropped["left"] -= 1
            return
        original(st, seq, payload)

    sub._on_live = drop_one
    try:
        first, second = sample_text(120, seed=21), sample_text(120, seed=22)
        k1 = block_keys(tokens_of(engine.url, model, first), BLOCK)
        k2 = block_keys(tokens_of(engine.url, model, second), BLOCK)
        # No replay in flight (the connection's settle replay would swallow the gap the next batch shows).
        wait_for(lambda: "settle" in rec.replays and sub.replays_ended == len(rec.replays), what="the connection's replays over")
        gaps = rec.replays.count("gap")
        complete(engine.url, model, first)  # its batch is the one dropped
        complete(engine.url, model, second)  # the next batch shows the gap
        wait_for(lambda: reported(index, k2) == len(k2), what="the second prompt's blocks")
        wait_for(lambda: reported(index, k1) == len(k1), what="the dropped batch's blocks, replayed")
        assert rec.replays.count("gap") == gaps + 1
    finally:
        sub._on_live = original


def test_a_prefix_cache_reset_clears_the_engines_entries(start_vllm, engine_args, follow, tiny_model):
    engine = start_vllm(**engine_args)
    index, _, _ = follow
    model = str(tiny_model)
    prompt = sample_text(150, seed=31)
    keys = block_keys(tokens_of(engine.url, model, prompt), BLOCK)
    complete(engine.url, model, prompt)
    wait_for(lambda: reported(index, keys) == len(keys), what="the prompt's blocks")
    r = httpx.post(f"{engine.url}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text
    # vLLM publishes the queued AllBlocksCleared with its next scheduler step: one more request makes one.
    after = sample_text(100, seed=32)
    after_keys = block_keys(tokens_of(engine.url, model, after), BLOCK)
    complete(engine.url, model, after)
    wait_for(lambda: reported(index, after_keys) == len(after_keys), what="the next prompt's blocks")
    assert reported(index, keys) == 0
    assert index.sizes()["engine"][0] == len(after_keys)


# In the extended tier (README, "Tests"): tests/integration/test_kv_subscriber.py restarts a publisher the same way.
@pytest.mark.extended
def test_a_restarted_engine_is_a_new_stream_without_stale_entries(start_vllm, engine_args, follow, tiny_model):
    engine = start_vllm(**engine_args)
    index, rec, _ = follow
    model = str(tiny_model)
    old = sample_text(150, seed=41)
    old_keys = block_keys(tokens_of(engine.url, model, old), BLOCK)
    complete(engine.url, model, old)
    wait_for(lambda: reported(index, old_keys) == len(old_keys), what="the old stream's blocks")
    connects = rec.replays.count("connected")
    engine.stop(grace=15)
    engine = start_vllm(**engine_args)  # the same event ports; numbered from 0 again
    wait_for(lambda: rec.replays.count("connected") > connects, what="the new stream's connection")
    new = sample_text(150, seed=42)
    new_keys = block_keys(tokens_of(engine.url, model, new), BLOCK)
    complete(engine.url, model, new)
    wait_for(lambda: reported(index, new_keys) == len(new_keys), what="the new stream's blocks")
    assert reported(index, old_keys) == 0
    assert index.sizes()["engine"][0] == len(new_keys)

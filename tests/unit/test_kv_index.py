"""The proxy's KV view, pure: event decoding (both of vLLM's encodings), the key space, the index."""

from __future__ import annotations

import threading

import msgspec
import pytest

from pdkv.errors import EventDecodeError
from pdkv.proxy.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, parse_seq
from pdkv.proxy.kv.index import KvIndex
from pdkv.proxy.kv.prefix import ROOT_KEY, block_keys, cacheable_blocks, chain_key

BS = 4
PROMPT = list(range(100, 114))  # 14 tokens: 3 full blocks of 4 and a tail of 2
_pack = msgspec.msgpack.Encoder().encode


def stored(hashes, parent, tokens, **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens, "block_size": BS,
            "lora_id": None, "medium": "GPU", "lora_name": None, **extra}


def test_block_keys_chain_over_full_blocks_only():
    keys = block_keys(PROMPT, BS)
    assert len(keys) == 3
    assert keys[0] == chain_key(ROOT_KEY, PROMPT[0:4])
    assert keys[2] == chain_key(chain_key(keys[0], PROMPT[4:8]), PROMPT[8:12])
    # A different first block changes every later key: the chain names the whole prefix.
    other = block_keys([1] + PROMPT[1:], BS)
    assert all(a != b for a, b in zip(keys, other, strict=True))
    assert block_keys(PROMPT, BS, extra="lora-a") != keys
    assert cacheable_blocks(12, 4) == 2 and cacheable_blocks(13, 4) == 3 and cacheable_blocks(0, 4) == 0
    with pytest.raises(ValueError):
        block_keys(PROMPT, 0)


def test_tagged_map_batch_decodes_and_unknown_fields_and_types_are_ignored():
    payload = _pack([1.5, [stored([b"h0", b"h1"], None, PROMPT[:8], session_id="s", future_field=[1, 2]),
                           {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "GPU"},
                           {"type": "SomethingNew", "x": 1},
                           {"type": "AllBlocksCleared"}], 0])
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0 and batch.unknown == 1
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert batch.events[0].token_ids == PROMPT[:8] and batch.events[0].block_hashes == [b"h0", b"h1"]


def test_positional_batch_decodes_with_int_hashes():
    payload = _pack([2.0, [["BlockStored", [11, 12], None, PROMPT[:8], BS, None, "GPU"], ["BlockRemoved", [12], "GPU"],
                           ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    first, second, third = batch.events
    assert isinstance(first, BlockStored) and first.block_hashes == [11, 12] and first.block_size == BS
    assert isinstance(second, BlockRemoved) and second.block_hashes == [12]
    assert isinstance(third, AllBlocksCleared)


@pytest.mark.parametrize("payload", [b"\xc1", _pack({"nope": 1}), _pack([1.0]), _pack([1.0, [stored("x", None, [1, 2, 3, 4])]]),
                                     _pack([1.0, [stored([b"a"], None, ["t"])]]), _pack([1.0, [42]])])
def test_malformed_payloads_are_one_decode_error(payload):
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_sequence_frames():
    assert parse_seq((7).to_bytes(8, "big")) == 7
    assert parse_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(EventDecodeError):
        parse_seq(b"\x00")


def _events(payload_events):
    return decode_batch(_pack([0.0, payload_events])).events


def test_index_matches_a_request_by_the_events_token_ids_not_vllms_hashes():
    idx = KvIndex()
    keys = block_keys(PROMPT, BS)
    # Engine hashes are arbitrary (vLLM's seed): only the chain over token ids matters.
    r = idx.apply("e", _events([stored([b"x", b"y"], None, PROMPT[:8]), stored([b"z"], b"y", PROMPT[8:12])]), now=0.0)
    assert r.stored == 3 and r.orphans == 0
    assert idx.hits("e", keys, now=0.0).reported == 3
    assert idx.hits("e", block_keys([0] + PROMPT[1:], BS), now=0.0).blocks == 0
    assert idx.hits("other", keys, now=0.0).blocks == 0
    assert idx.block_size("e") == BS
    # Removing the middle block leaves only the first as a leading hit.
    idx.apply("e", _events([{"type": "BlockRemoved", "block_hashes": [b"y"], "medium": "GPU"}]), now=0.0)
    assert idx.hits("e", keys, now=0.0).reported == 1
    idx.apply("e", _events([{"type": "AllBlocksCleared"}]), now=0.0)
    assert idx.hits("e", keys, now=0.0).blocks == 0
    assert idx.sizes()["e"] == (0, 0, False)


def test_orphans_offload_tiers_and_restores():
    idx = KvIndex()
    r = idx.apply("e", _events([stored([b"q"], b"never-seen", PROMPT[4:8]), stored([b"c"], None, PROMPT[:4], medium="CPU"),
                                stored([b"g"], None, PROMPT[:4], group_idx=1), stored([b"a", b"b"], None, PROMPT[:4])]), now=0.0)
    assert (r.stored, r.orphans, r.ignored) == (0, 3, 2)
    # The same block reported again (a reuse report) is counted once, and one removal drops it.
    idx.apply("e", _events([stored([b"a"], None, PROMPT[:4]), stored([b"a"], None, PROMPT[:4])]), now=0.0)
    assert idx.sizes()["e"][0] == 1
    idx.apply("e", _events([{"type": "BlockRemoved", "block_hashes": [b"a"], "medium": "GPU"}]), now=0.0)
    assert idx.sizes()["e"][0] == 0


def test_lora_blocks_do_not_match_plain_requests():
    idx = KvIndex()
    idx.apply("e", _events([stored([b"a"], None, PROMPT[:4], lora_name="adapter")]), now=0.0)
    assert idx.hits("e", block_keys(PROMPT, BS), now=0.0).blocks == 0


def test_predictions_count_until_they_expire_and_events_confirm_them():
    idx = KvIndex(predict_ttl_s=5.0)
    keys = block_keys(PROMPT, BS)
    idx.apply("e", _events([stored([b"a"], None, PROMPT[:4])]), now=0.0)
    assert idx.predict("e", keys, now=10.0) == 2  # the first is already reported
    assert idx.silent_since("e") == 10.0
    assert idx.hits("e", keys, now=12.0) == idx.hits("e", keys, now=12.0)
    h = idx.hits("e", keys, now=12.0)
    assert (h.reported, h.predicted, h.blocks) == (1, 2, 3)
    assert idx.hits("e", keys, now=15.5).blocks == 1  # expired
    idx.predict("e", keys, now=20.0)
    idx.apply("e", _events([stored([b"b", b"c"], b"a", PROMPT[4:12])]), now=20.1)
    assert idx.silent_since("e") is None  # the events came
    assert idx.hits("e", keys, now=100.0).reported == 3


def test_approximate_view_routes_by_predictions_alone():
    idx = KvIndex(predict_ttl_s=1.0, approximate_ttl_s=60.0)
    keys = block_keys(PROMPT, BS)
    idx.apply("e", _events([stored([b"a"], None, PROMPT[:4])]), now=0.0)
    assert idx.mark_approximate("e", True) is True
    assert idx.mark_approximate("e", True) is False
    assert idx.hits("e", keys, now=0.0).blocks == 0  # the reported view is not trusted
    idx.predict("e", keys, now=1.0)
    assert idx.hits("e", keys, now=30.0).predicted == 3
    assert idx.hits("e", keys, now=62.0).blocks == 0
    idx.mark_approximate("e", False)
    idx.reset("e")
    assert idx.hits("e", keys, now=62.0).blocks == 0


def test_reset_forgets_reported_blocks_of_an_old_stream():
    idx = KvIndex()
    idx.apply("e", _events([stored([b"a", b"b"], None, PROMPT[:8])]), now=0.0)
    idx.reset("e")
    assert idx.hits("e", block_keys(PROMPT, BS), now=0.0).blocks == 0
    # A child of a block from the old stream is an orphan now, not a hit.
    assert idx.apply("e", _events([stored([b"c"], b"b", PROMPT[8:12])]), now=0.0).orphans == 1


def test_index_under_many_threads_stays_consistent():
    idx = KvIndex(predict_ttl_s=1e9)
    prompts = [[t + 1000 * i for t in range(32)] for i in range(16)]
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            hashes = [f"{i}-{b}".encode() for b in range(8)]
            for _ in range(50):
                idx.apply("e", _events([stored(hashes, None, prompts[i])]), now=0.0)
                idx.apply("e", _events([{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}]), now=0.0)
            idx.apply("e", _events([stored(hashes, None, prompts[i])]), now=0.0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader(i: int) -> None:
        try:
            for _ in range(200):
                h = idx.hits("e", block_keys(prompts[i], BS), now=0.0)
                assert 0 <= h.blocks <= 8
                idx.predict("r", block_keys(prompts[i], BS), now=0.0)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(16)]
    threads += [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert idx.sizes()["e"][0] == 16 * 8
    assert all(idx.hits("e", block_keys(p, BS), now=0.0).reported == 8 for p in prompts)

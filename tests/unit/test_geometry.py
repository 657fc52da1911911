from __future__ import annotations

import pytest

from pdkv.errors import ConfigError, UnsupportedModelError, UsageError
from pdkv.geometry import dense_geometry, geometry_from_config, geometry_from_model, load_config, size_transfer, rank_transfers


def test_seed_numbers_for_qwen3_8b(qwen3_8b):
    plan = size_transfer(geometry_from_model(qwen3_8b), prompt_tokens=1000, output_tokens=128)
    assert plan.bytes_per_token == 147456
    assert plan.bytes_per_block == 2359296
    assert plan.blocks == 63
    assert (plan.full_blocks, plan.tail_tokens) == (62, 8)
    assert plan.transfer_bytes == 148635648
    assert plan.floor_ms == pytest.approx(2.973, abs=0.001)
    assert plan.decode_blocks == 71
    assert geometry_from_model(qwen3_8b).block_bytes_per_layer(16) == 64 * 1024


def test_explicit_geometry_matches_config(qwen3_8b):
    assert dense_geometry(36, 8, 128, "bfloat16") == geometry_from_model(qwen3_8b)


@pytest.mark.parametrize(("tp", "heads"), [(1, 8), (2, 4), (8, 1), (16, 1)])
def test_tp_splits_then_replicates_kv_heads(qwen3_8b, tp, heads):
    g = geometry_from_model(qwen3_8b, tp=tp)
    assert g.kv_heads == heads
    assert g.bytes_per_token == 2 * 36 * heads * 128 * 2


@pytest.mark.parametrize("tp", [3, 12, 0])
def test_tp_that_cannot_split_is_refused(qwen3_8b, tp):
    with pytest.raises(UsageError):
        geometry_from_model(qwen3_8b, tp=tp)


def test_mla_is_one_latent_per_token_per_layer(fixtures):
    g = geometry_from_model(fixtures / "configs" / "deepseek-v2-lite.json")
    assert g.attention == "mla"
    assert g.bytes_per_token == 27 * (512 + 64) * 2
    # MLA's latent is replicated on every TP rank, not split.
    assert geometry_from_model(fixtures / "configs" / "deepseek-v2-lite.json", tp=4).bytes_per_token == g.bytes_per_token


@pytest.mark.parametrize(("name", "word"), [
    ("mistral-7b-v0.1.json", "sliding-window"),
    ("jamba.json", "Mamba"),
    ("gemma3-layers.json", "sliding_attention"),
])
def test_unsizable_architectures_are_refused(fixtures, name, word):
    with pytest.raises(UnsupportedModelError, match=word):
        geometry_from_model(fixtures / "configs" / name)


def test_dtype_override_and_head_dim_from_hidden():
    g = geometry_from_config(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "float32"}, dtype="fp8"
    )
    assert (g.kv_heads, g.head_dim, g.dtype_bytes) == (4, 64, 1)


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no model config"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        geometry_from_config({"num_attention_heads": 4})
    with pytest.raises(ConfigError, match="positive integer"):
        geometry_from_config({"num_hidden_layers": "36", "num_attention_heads": 4})
    with pytest.raises(UsageError, match="unknown dtype"):
        dense_geometry(1, 1, 1, "int3")


def test_plan_rejects_bad_numbers(qwen3_8b):
    g = geometry_from_model(qwen3_8b)
    for kwargs in ({"block_size": 0}, {"prompt_tokens": -1}, {"link_gbps": 0}):
        args = {"prompt_tokens": 10, **kwargs}
        with pytest.raises(UsageError):
            size_transfer(g, **args)


def test_rank_transfers_add_up_to_the_whole_prompt():
    g = dense_geometry(36, 8, 128, "bfloat16")
    whole = size_transfer(g, prompt_tokens=1000).transfer_bytes
    for p_tp, d_tp in ((1, 2), (2, 1), (1, 4), (4, 2), (2, 2)):
        ranks = rank_transfers(g, p_tp, d_tp, prompt_tokens=1000, block_size=16)
        assert sum(r.bytes for r in ranks) == whole, (p_tp, d_tp)
    [a, b] = rank_transfers(g, 2, 1, prompt_tokens=1000, block_size=16)
    assert (a.p_rank, b.p_rank, a.heads, a.descriptors) == (0, 1, 4, 36 * 63)
    assert [r.descriptors for r in rank_transfers(g, 2, 2, prompt_tokens=1000, block_size=16)] == [36, 36]


def test_mla_ranks_take_the_whole_latent_from_one_p_rank():
    g = geometry_from_config({"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"})
    ranks = rank_transfers(g, 1, 2, prompt_tokens=64, block_size=16)
    assert [(r.p_rank, r.d_rank, r.bytes) for r in ranks] == [(0, 0, 4 * 4 * 16 * 576 * 2), (0, 1, 4 * 4 * 16 * 576 * 2)]

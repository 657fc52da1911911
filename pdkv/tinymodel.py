"""A deterministic tiny Qwen3-architecture model that vLLM loads offline.

`write_tiny_model(dir)` writes config.json, a byte-level BPE tokenizer trained
on the spot with `tokenizers`, and bf16 safetensors weights drawn from a
seeded normal. The same seed gives the same bytes. Real random weights, not
`--load-format dummy`: dummy weights are near-constant and decode every prompt
to the same tokens, which would hide a KV cache that arrived wrong.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import msgspec

from pdkv.errors import UsageError

WORDS = (
    "the a an of to in on for with from by at as is was are be been prefill decode cache block token "
    "layer head key value request prompt engine worker server proxy transfer memory bytes link queue "
    "model river mountain city light stone water garden window paper music winter summer morning night "
    "quick slow bright quiet green blue small large old new first last open close read write send keep "
    "one two three four five six seven eight nine ten hundred thousand north south east west"
).split()

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A CPU engine's KV cache for the tiny model: 512 B a token (2 layers, K and V, 2 heads of 32 bf16), so 64 MiB holds
# 131,072 tokens, 64 prompts of 2,048. vLLM fills the whole cache before an engine is ready: 1 GiB took ~8 s a start.
TINY_KV_CACHE_BYTES = 64 << 20

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TinyModelSpec(msgspec.Struct, frozen=True):
    """Shape of the tiny model; the defaults are what pdkv's tests and `pdkv up` serve."""

    layers: int = 2
    hidden: int = 128
    intermediate: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    vocab: int = 2048
    max_positions: int = 4096
    std: float = 0.02
    seed: int = 0


def _corpus(seed: int, sentences: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        n = rng.randint(5, 16)
        lines.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return lines


def _train_tokenizer(spec: TinyModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab - len(SPECIAL_TOKENS),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _bf16_bytes(values) -> bytes:
    """float32 array -> bf16 bytes, rounding to nearest even."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))
    return (rounded >> 16).astype("<u2").tobytes()


def _write_safetensors(path: Path, tensors: dict[str, object]) -> None:
    """Write bf16 tensors in the safetensors format (header JSON + raw little-endian data)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        array = tensors[name]
        data = _bf16_bytes(array)
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    head += b" " * (-len(head) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def _weights(spec: TinyModelSpec) -> dict[str, object]:
    import numpy as np

    rng = np.random.default_rng(spec.seed)

    def normal(*shape: int):
        return rng.normal(0.0, spec.std, size=shape).astype(np.float32)

    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    h, hd = spec.hidden, spec.head_dim
    tensors: dict[str, object] = {"model.embed_tokens.weight": normal(spec.vocab, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones(h)
        tensors[p + "post_attention_layernorm.weight"] = ones(h)
        tensors[p + "self_attn.q_proj.weight"] = normal(spec.heads * hd, h)
        tensors[p + "self_attn.k_proj.weight"] = normal(spec.kv_heads * hd, h)
        tensors[p + "self_attn.v_proj.weight"] = normal(spec.kv_heads * hd, h)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, spec.heads * hd)
        tensors[p + "self_attn.q_norm.weight"] = ones(hd)
        tensors[p + "self_attn.k_norm.weight"] = ones(hd)
        tensors[p + "mlp.gate_proj.weight"] = normal(spec.intermediate, h)
        tensors[p + "mlp.up_proj.weight"] = normal(spec.intermediate, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, spec.intermediate)
    tensors["model.norm.weight"] = ones(h)
    tensors["lm_head.weight"] = normal(spec.vocab, h)
    return tensors


def _config(spec: TinyModelSpec, eos_id: int, bos_id: int) -> dict[str, object]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_positions,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": spec.std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def write_tiny_model(directory: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the tiny model into `directory` (created if missing) and return it."""
    if spec.kv_heads <= 0 or spec.heads % spec.kv_heads:
        raise UsageError(f"{spec.heads} attention heads cannot be grouped over {spec.kv_heads} KV heads")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(spec)
    eos_id = tok.token_to_id("<|endoftext|>")
    bos_id = tok.token_to_id("<|im_start|>")
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": spec.max_positions,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    })
    _write_json(out / "special_tokens_map.json", {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    _write_json(out / "config.json", _config(spec, eos_id, bos_id))
    _write_json(out / "generation_config.json", {"eos_token_id": eos_id, "bos_token_id": bos_id})
    _write_safetensors(out / "model.safetensors", _weights(spec))
    return out


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def sample_text(words: int, seed: int = 1) -> str:
    """Deterministic text in the tiny model's vocabulary, about `words` words long."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def cache_dir() -> Path:
    root = os.environ.get("PDKV_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdkv")
    return Path(root)


def tiny_model_path() -> Path:
    return cache_dir() / "tiny-model"


def ensure_tiny_model(path: Path | None = None) -> Path:
    """The embedded tiny model in the cache, written (atomically) when missing."""
    path = path or tiny_model_path()
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    write_tiny_model(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path

"""The proxy's own tokenizer (pdkv.proxy.kv.tokenize) gives the token ids vLLM's renderer (transformers) gives, on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdkv.errors import ConfigError
from pdkv.proxy.kv.tokenize import LocalTokenizer
from pdkv.tinymodel import sample_text

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdkv.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tok"))


def test_chat_and_prompts_match_transformers(model: Path) -> None:
    local, hf = LocalTokenizer(model), transformers.AutoTokenizer.from_pretrained(str(model))
    messages = [{"role": "system", "content": sample_text(60, seed=1)}, {"role": "user", "content": "the cache"},
                {"role": "assistant", "content": "block token"}, {"role": "user", "content": sample_text(20, seed=2)}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert local.token_ids({"messages": messages}, "/v1/chat/completions") == list(expected)
    parts = [*messages[:-1], {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    joined = hf.apply_chat_template([*messages[:-1], {"role": "user", "content": "a\nb"}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
    assert local.token_ids({"messages": parts}, "/v1/chat/completions") == list(joined)
    prompt = sample_text(80, seed=3)
    assert local.token_ids({"prompt": prompt}, "/v1/completions") == hf(prompt)["input_ids"]
    assert local.token_ids({"prompt": [5, 6, 7]}, "/v1/completions") == [5, 6, 7]


def test_what_it_cannot_render_goes_to_the_engine(model: Path) -> None:
    local = LocalTokenizer(model)
    msgs = [{"role": "user", "content": "x"}]
    assert local.token_ids({"messages": msgs, "tools": []}, "/v1/chat/completions") is None
    assert local.token_ids({"messages": msgs, "chat_template": "{{ 1 }}"}, "/v1/chat/completions") is None
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert local.token_ids({"messages": image}, "/v1/chat/completions") is None
    assert local.token_ids({"prompt": ["a", "b"]}, "/v1/completions") is None


def test_a_folder_without_a_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        LocalTokenizer(tmp_path)

"""One colocated vLLM on the tiny model: greedy decoding is repeatable and prompt-dependent.

This proves the harness (start, health, requests, stop) and that the tiny
model is a usable probe: if every prompt decoded alike, a KV cache that
arrived wrong could pass unnoticed in the P/D tests.
"""

from __future__ import annotations

import itertools

import httpx
import pytest

from pdkv.tinymodel import sample_text

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The river runs north to the city",
    "Prefill the cache block and send every token",
    sample_text(40, seed=3),
    "one two three four five",
]
MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-3  # the second run may reuse cached prefix blocks; sums differ in the last bits


def greedy(url: str, model: str, prompt: str) -> tuple[list[str], list[float], str]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"], choice["text"]


def test_greedy_completions_repeat_and_depend_on_the_prompt(start_vllm, tiny_model) -> None:
    engine = start_vllm(role="none", name="colocated")
    model = str(tiny_model)
    first = [greedy(engine.url, model, p) for p in PROMPTS]
    second = [greedy(engine.url, model, p) for p in PROMPTS]

    for prompt, (tok1, lp1, _), (tok2, lp2, _) in zip(PROMPTS, first, second, strict=True):
        assert len(tok1) == MAX_TOKENS
        assert tok1 == tok2, f"greedy tokens changed between runs for {prompt!r}"
        assert lp1 == pytest.approx(lp2, abs=LOGPROB_TOLERANCE), f"logprobs changed between runs for {prompt!r}"

    for (i, (tok_a, lp_a, _)), (j, (tok_b, lp_b, _)) in itertools.combinations(enumerate(first), 2):
        differs = tok_a != tok_b or any(abs(a - b) > LOGPROB_TOLERANCE for a, b in zip(lp_a, lp_b, strict=True))
        assert differs, f"prompts {i} and {j} decoded to the same tokens and logprobs"

"""Building blocks of the e2e P/D pairs: engine specs on the tiny model, prompts, requests and their answers."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np

from pdkv.deploy.plan.engine import EngineSpec
from pdkv.tinymodel import TINY_KV_CACHE_BYTES
from support.ports import free_port

BLOCK = 32
LENGTHS = (1, 15, 16, 17, 31, 32, 33, 1000)
MAX_TOKENS = 8
LOGPROB_TOL = 0.02  # bf16: D's one-token forward vs the colocated prefill of the same position
SHIM = Path(__file__).resolve().parents[1] / "shims" / "cpu_accelerator"
START_S = float(os.environ.get("PDKV_E2E_START_TIMEOUT", "300"))
PDKV_EXTRA = {"unknown_wait_s": 4, "expiry_s": 20, "liveness_s": 5, "heartbeat_s": 0.5}


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(100, vocab - 100, size=n)]


def complete(url: str, body: dict, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=timeout)


def answer(r: httpx.Response) -> tuple[list[str], list[dict[str, float]]]:
    assert r.status_code == 200, r.text[:500]
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["top_logprobs"]


def body(model: str, ids: list[int], **kw) -> dict:
    # Tokens as "token_id:N": the tiny tokenizer renders many ids as "", which would merge top-logprob keys.
    return {
        "model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 5,
        "ignore_eos": True, "return_tokens_as_token_ids": True, **kw,
    }


KV_CACHE_BYTES = TINY_KV_CACHE_BYTES  # each e2e engine's KV cache, the tiny model's as `pdkv up` sizes it


def spec(model: Path, role: str, connector: str, omp: str, transport: str = "tcp", **kw) -> EngineSpec:
    return EngineSpec(
        model=str(model), host="127.0.0.1", port=free_port(), role=role, connector=connector,  # type: ignore[arg-type]
        transport=transport, platform="cpu", block_size=BLOCK, max_model_len=1024, host_ip="127.0.0.1", omp_bind=omp,
        cpu_kv_cache_bytes=KV_CACHE_BYTES, **kw,
    )

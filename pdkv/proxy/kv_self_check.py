"""The kv-aware policy's start-up self-check, one per engine whose KV events it follows.

One fresh prompt goes straight to the engine, and the check waits (bounded) for the engine's events to report
exactly the block keys the proxy computes for that prompt: a mismatch (another tokenizer, block size or salt)
is a loud warning and `pdkv_proxy_kv_self_check{engine} 0`, never silent zero hits. The proxy's own tokenizer,
if it has one, is compared with the engine's on the way (engine_tokens.PromptTokens.check).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec

from pdkv.proxy.backends import Backends, BackendState
from pdkv.proxy.engine_tokens import PromptTokens
from pdkv.proxy.http import UpstreamError, fetch
from pdkv.proxy.kv import KvConfig, KvIndex, KvMetrics, block_keys

log = logging.getLogger("pdkv.proxy.kv")
_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
SELF_CHECK_TIMEOUT_S = 30.0
SELF_CHECK_EVENTS_S = 10.0  # from the self-check's answer to its blocks' events
SELF_CHECK_TEXT = ("the prefill engine computes the prompt and the decode engine holds the cache for the next turn of the chat "
                   "while the proxy routes every request to the block that is already there ") * 3


class SelfChecks:
    """Each followed engine's check result (`results`: engine -> ok | mismatch | no_events | failed: ...)."""

    def __init__(self, config: KvConfig, index: KvIndex, metrics: KvMetrics, tokens: PromptTokens) -> None:
        self.config, self.index, self.metrics, self.tokens = config, index, metrics, tokens
        self.results: dict[str, str] = {}

    async def check(self, engine: str, backends: Backends) -> None:
        state = next((b for b in (*backends.prefills, *backends.decodes) if b.url == engine), None)
        if state is None:
            self._result(engine, "failed: the proxy does not route to this engine", 0)
            return
        while not state.up:
            await asyncio.sleep(0.5)
        try:
            ok = await asyncio.wait_for(self._once(engine, state), SELF_CHECK_TIMEOUT_S)
        except (asyncio.TimeoutError, UpstreamError, msgspec.DecodeError, KeyError, TypeError) as exc:
            self._result(engine, f"failed: {exc or type(exc).__name__}", -1)
            return
        self._result(engine, *ok)

    async def _once(self, engine: str, state: BackendState) -> tuple[str, int]:
        models = await fetch(state.pool, "GET", "/v1/models", timeout=self.config.tokenize_timeout_s)
        model = _json_decode(models.body)["data"][0]["id"]
        # The nonce leads, so every block of the prompt is new to the engine and reported now.
        prompt = f"{uuid.uuid4().hex} {SELF_CHECK_TEXT}"
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        tokens = await self.tokens.engine(body, "/v1/completions", state.pool)
        if tokens is None:
            return "failed: the engine's /tokenize did not answer", -1
        await self.tokens.check(prompt, model, state.pool, SELF_CHECK_TEXT)
        ex = await fetch(state.pool, "POST", "/v1/completions", body=_json_encode(body), timeout=SELF_CHECK_TIMEOUT_S)
        if ex.status != 200:
            return f"failed: the self-check prompt was answered {ex.status}", -1
        deadline = time.monotonic() + SELF_CHECK_EVENTS_S
        while time.monotonic() < deadline:
            size = self.config.block_size or self.index.block_size(engine)
            if size:
                keys = block_keys(tokens, size)
                if keys and self.index.hits(engine, keys, time.monotonic()).reported == len(keys):
                    return "ok", 1
            await asyncio.sleep(0.1)
        if self.index.block_size(engine) is None:
            return f"no_events: none came from the engine within {SELF_CHECK_EVENTS_S:.0f} s", -1
        return "mismatch: the engine stored the prompt's blocks under other keys (another tokenizer, block size or salt?)", 0

    def _result(self, engine: str, result: str, value: int) -> None:
        self.results[engine] = result
        self.metrics.self_check.labels(engine).set(value)
        if value == 1:
            log.info("kv-aware: engine %s's KV events match the proxy's block keys", engine)
        else:
            log.warning("kv-aware: SELF-CHECK %s for engine %s: its prefix hits cannot be trusted "
                        "(check that it runs with --kv-events-config and the same block size)", result.upper(), engine)

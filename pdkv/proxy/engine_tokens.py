"""A request's prompt as the engine's token ids, from its `/tokenize` (pdkv.engine_api over the backend's pool).

The chat template is applied by the engine itself (the same code, the same tokenizer), so the ids are those its
scheduler will hash into block keys. A batch of prompts, an answer that is not 200, or one without `tokens`
gives None, never an exception: the kv-aware policy then routes without prefix hits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from pdkv.engine_api import CHAT_FIELDS, AsyncEngineClient, ChatTokenize, CompletionTokenize
from pdkv.errors import RemoteError, UnreachableError
from pdkv.proxy.http import PoolTransport, UpstreamPool
from pdkv.proxy.kv import LocalTokenizer, completion_prompt

log = logging.getLogger("pdkv.proxy.kv")


async def engine_token_ids(pool: UpstreamPool, body: dict[str, Any], endpoint: str, *, timeout: float) -> list[int] | None:
    """The token ids the engine behind `pool` gives the prompt of `body` (a request to `endpoint`), or None."""
    req: ChatTokenize | CompletionTokenize
    if endpoint.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list):
            return None
        req = ChatTokenize(**{k: body[k] for k in (*CHAT_FIELDS, "model") if k in body})
    else:
        prompt = completion_prompt(body)
        if not isinstance(prompt, str):
            return prompt
        req = CompletionTokenize(prompt, body.get("add_special_tokens", True), body.get("model", msgspec.UNSET))
    try:
        return (await AsyncEngineClient(pool.origin, timeout=timeout, transport=PoolTransport(pool)).tokenize(req)).tokens
    except (UnreachableError, RemoteError) as exc:
        log.debug("/tokenize failed: %s", exc)
        return None


class PromptTokens:
    """A request's token ids: the proxy's own tokenizer when it has one that can render the request, else the
    engine's /tokenize. `check` compares the two on an engine once and drops the proxy's on any difference."""

    def __init__(self, local: LocalTokenizer | None, timeout_s: float, on_match: Callable[[bool], None]) -> None:
        self.local = local
        self.timeout_s = timeout_s
        self.on_match = on_match  # True: the proxy's tokenizer gives the engine's ids; False: it was dropped

    async def token_ids(self, body: dict[str, Any], endpoint: str, pool: UpstreamPool) -> list[int] | None:
        if self.local is not None:
            ids = self.local.token_ids(body, endpoint)
            if ids is not None:
                return ids
        return await self.engine(body, endpoint, pool)

    async def engine(self, body: dict[str, Any], endpoint: str, pool: UpstreamPool) -> list[int] | None:
        return await engine_token_ids(pool, body, endpoint, timeout=self.timeout_s)

    async def check(self, prompt: str, model: str, pool: UpstreamPool, system: str) -> None:
        """The proxy's tokenizer must give the engine's token ids for a prompt and a chat, or it is not used."""
        local = self.local
        if local is None:
            return
        completion = {"model": model, "prompt": prompt, "max_tokens": 1}
        chat = {"model": model, "messages": [{"role": "system", "content": system[:200]}, {"role": "user", "content": prompt[:120]}]}
        for endpoint, request in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
            mine, theirs = local.token_ids(request, endpoint), await self.engine(request, endpoint, pool)
            if theirs is not None and mine != theirs:
                log.warning("kv-aware: the proxy's tokenizer (%s) differs from the engine's for %s; asking the engine's "
                            "/tokenize instead", local.folder, endpoint)
                self.local = None
                self.on_match(False)
                return
        self.on_match(True)

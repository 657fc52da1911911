"""A load client for e2e tests: many OpenAI requests in flight, each answer kept as token ids and logprobs.

`Case` is one request (endpoint, prompt, streaming or not, cancelled after
some events or not); `run_load` sends cases at a concurrency and returns one
`Answer` each; `same_greedy_answer` compares an answer with P alone's,
allowing a divergence only where P alone's top two tokens were tied.
`free_port` and `kv_usage` serve the suites that start engines.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


MAX_TOKENS = 8
TIE_LOGPROB = 1e-3  # top-two logprobs closer than this are a tie: batch order may pick either
FIRST_LOGPROB_TOL = 2e-2  # KV in the wrong blocks moves the first token's logprob far more than this

WORDS = (
    "river north city stone light market bridge winter garden harbor signal copper valley lantern forest"
    " engine silver meadow thunder canvas orbit pillar candle mirror glacier falcon ember quartz willow"
).split()


@dataclass(frozen=True)
class Case:
    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    prompt: str
    stream: bool
    cancel_after: int | None = None  # streaming: hang up after this many events


@dataclass
class Answer:
    status: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top2_gap: list[float] = field(default_factory=list)  # logprob gap between the top two candidates, per token
    error: str = ""
    cancelled: bool = False
    seconds: float = 0.0


def prompts(seed: int, word_counts: list[int]) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in word_counts]


def body_of(case: Case, model: str, top: int = 1) -> dict:
    body: dict = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                  "return_tokens_as_token_ids": True, "stream": case.stream}
    if case.endpoint == "/v1/completions":
        body |= {"prompt": case.prompt, "logprobs": top}
    else:
        body |= {"messages": [{"role": "user", "content": case.prompt}], "logprobs": True, "top_logprobs": top}
    return body


def _take_logprobs(choice: dict, out: Answer) -> None:
    lp = choice.get("logprobs") or {}
    if "content" in lp:  # chat
        for item in lp["content"] or []:
            out.tokens.append(int(item["token"].split(":", 1)[1]))
            out.logprobs.append(item["logprob"])
            tops = sorted((t["logprob"] for t in item.get("top_logprobs") or []), reverse=True)
            out.top2_gap.append(tops[0] - tops[1] if len(tops) > 1 else float("inf"))
    else:  # completions
        for tok, logprob, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or [], strict=False):
            out.tokens.append(int(tok.split(":", 1)[1]))
            out.logprobs.append(logprob)
            tops = sorted((top or {}).values(), reverse=True)
            out.top2_gap.append(tops[0] - tops[1] if len(tops) > 1 else float("inf"))


async def one(client: httpx.AsyncClient, base: str, case: Case, model: str, top: int = 1, timeout: float = 120.0) -> Answer:
    out = Answer()
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            if not case.stream:
                r = await client.post(base + case.endpoint, json=body_of(case, model, top))
                out.status = r.status_code
                if r.status_code == 200:
                    _take_logprobs(r.json()["choices"][0], out)
                else:
                    out.error = r.text[:300]
            else:
                async with client.stream("POST", base + case.endpoint, json=body_of(case, model, top)) as r:
                    out.status = r.status_code
                    if r.status_code != 200:
                        out.error = (await r.aread()).decode("utf-8", "replace")[:300]
                        return _timed(out, start)
                    events = 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            out.error = json.dumps(event["error"])[:300]
                            break
                        for choice in event.get("choices") or []:
                            _take_logprobs(choice, out)
                        events += 1
                        if case.cancel_after is not None and events >= case.cancel_after:
                            out.cancelled = True
                            break
    except TimeoutError:
        out.error = f"no answer within {timeout:g} s"
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return _timed(out, start)


def _timed(out: Answer, start: float) -> Answer:
    out.seconds = time.monotonic() - start
    return out


async def run_load(base: str, cases: list[Case], model: str, concurrency: int, *, top: int = 1) -> list[Answer]:
    """Send every case with at most `concurrency` in flight; answers in case order."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits, trust_env=False) as client:

        async def bounded(case: Case) -> Answer:
            async with sem:
                return await one(client, base, case, model, top)

        return await asyncio.gather(*(bounded(c) for c in cases))


def same_greedy_answer(got: Answer, want: Answer) -> str | None:
    """Why `got` is not P alone's greedy answer `want`, or None. Compared up to the first tie in `want`."""
    if not got.tokens:
        return None if got.cancelled else "no tokens"  # a chat stream's first event carries the role alone
    if abs(got.logprobs[0] - want.logprobs[0]) > FIRST_LOGPROB_TOL:
        return f"first token logprob {got.logprobs[0]:.4f}, P alone {want.logprobs[0]:.4f}"
    for i, (a, b) in enumerate(zip(got.tokens, want.tokens, strict=False)):
        if a != b:
            if want.top2_gap[i] < TIE_LOGPROB:
                return None
            return f"token {i}: {a}, P alone {b} (P alone's top-two gap {want.top2_gap[i]:.4f})"
    if not got.cancelled and len(got.tokens) != len(want.tokens):
        return f"{len(got.tokens)} tokens, P alone {len(want.tokens)}"
    return None


def kv_usage(url: str) -> float:
    """An engine's `vllm:kv_cache_usage_perc` (the largest, with several label sets)."""
    text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc")]
    assert values, f"{url}/metrics has no vllm:kv_cache_usage_perc"
    return max(values)


ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
WORD_COUNTS = [1, 4, 17, 40, 80, 150, 220, 270]  # 2 to ~990 tokens with the tiny model's tokenizer
PROMPTS = prompts(7, WORD_COUNTS)


def mixed_cases(n: int, seed: int, cancel_share: float = 0.0) -> list[Case]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        stream = i % 2 == 1
        cancel = stream and rng.random() < cancel_share
        out.append(Case(ENDPOINTS[(i // 2) % 2], PROMPTS[rng.randrange(len(PROMPTS))], stream,
                        cancel_after=rng.randint(1, 6) if cancel else None))
    return out


def closed_loop(base: str, cases: list[Case], model: str, concurrency: int, stop: Any, *,
                timeout: float = 120.0) -> list[tuple[float, int, Answer]]:
    """`concurrency` clients, each sending the next of `cases` (cycled) as soon as its last answer came, until
    `stop` (a threading.Event) is set; (time.monotonic() at send, case index, answer) of every request, in send order."""
    out: list[tuple[float, int, Answer]] = []
    counter = iter(range(10**9))

    async def worker(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            i = next(counter) % len(cases)
            sent = time.monotonic()
            out.append((sent, i, await one(client, base, cases[i], model, timeout=timeout)))

    async def main() -> None:
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, trust_env=False) as client:
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))

    asyncio.run(main())
    return sorted(out, key=lambda item: item[0])

"""The routing benchmark's workloads and engine counters (benchmarks/routing.py runs them): multi-turn chats, unique prompts."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time

import numpy as np
from load import prefix_cache_counters as counters  # noqa: F401 - one reading of vLLM's prefix-cache counters

SERVED = "tiny"


_GIVEN: set[int] = set()


def free_port(pair: bool = False) -> int:
    """A loopback port free now and never handed out before by this process (`pair`: it and the next one).

    The engines start together and bind their ports tens of seconds after all were picked: a port the kernel
    still calls free may already be another engine's."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ports = (port, port + 1) if pair else (port,)
        if _GIVEN.intersection(ports):
            continue
        if pair:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        _GIVEN.update(ports)
        return port
    raise RuntimeError("no free port")


def rate(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float | None:
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return round(hits / queries, 4) if queries > 0 else None


async def stream_one(client, url: str, path: str, body: dict) -> tuple[float, str, float]:
    """(ttft_s, text, total_s) of one streamed request; raises on an error status."""
    t0 = time.perf_counter()
    ttft, parts = None, []
    async with client.stream("POST", f"{url}{path}", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(str(event["error"])[:300])
            for choice in event.get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return ttft if ttft is not None else float("nan"), "".join(parts), time.perf_counter() - t0


def conversations(args: argparse.Namespace) -> tuple[str, list[list[str]]]:
    from pdkv.tinymodel import sample_text

    system = sample_text(args.system_words, seed=args.seed)
    users = [[sample_text(args.turn_words, seed=args.seed + 1000 * (c + 1) + t) for t in range(args.turns)]
             for c in range(args.conversations)]
    return system, users


async def multi_turn(url: str, args: argparse.Namespace) -> dict:
    import httpx

    system, users = conversations(args)
    ttfts: list[float] = []
    errors: list[str] = []
    rng = np.random.default_rng(args.seed)
    starts = rng.uniform(0, args.stagger_s, len(users))

    async def chat(c: int, client) -> None:
        await asyncio.sleep(float(starts[c]))
        history = [{"role": "system", "content": system}]
        for turn in users[c]:
            history.append({"role": "user", "content": turn})
            body = {"model": SERVED, "messages": history, "max_tokens": args.answer_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            try:
                ttft, text, _ = await stream_one(client, url, "/v1/chat/completions", body)
            except Exception as exc:  # noqa: BLE001 - counted; the conversation goes on
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                text, ttft = "-", None
            if ttft is not None:
                ttfts.append(ttft)
            history.append({"role": "assistant", "content": text})

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, trust_env=False, limits=httpx.Limits(max_connections=256)) as client:
        await asyncio.gather(*(chat(c, client) for c in range(len(users))))
    wall = time.perf_counter() - t0
    return summarize(ttfts, errors, wall)


async def unique(url: str, args: argparse.Namespace, seed: int) -> dict:
    import httpx

    from pdkv.tinymodel import sample_text

    # Each prompt leads with its own number words, so no two share their first block.
    prompts = [f"{i} {i * 7919} " + sample_text(args.unique_words, seed=seed + i) for i in range(args.unique)]
    sem = asyncio.Semaphore(args.unique_concurrency)
    ttfts: list[float] = []
    errors: list[str] = []

    async def one(p: str, client) -> None:
        async with sem:
            body = {"model": SERVED, "prompt": p, "max_tokens": args.answer_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            try:
                ttft, _, _ = await stream_one(client, url, "/v1/completions", body)
                ttfts.append(ttft)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{type(exc).__name__}: {exc}"[:200])

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, trust_env=False, limits=httpx.Limits(max_connections=256)) as client:
        await asyncio.gather(*(one(p, client) for p in prompts))
    return summarize(ttfts, errors, time.perf_counter() - t0)


def summarize(ttfts: list[float], errors: list[str], wall: float) -> dict:
    arr = np.array(ttfts) * 1000 if ttfts else np.array([np.nan])
    return {"completed": len(ttfts), "failed": len(errors), "wall_s": round(wall, 2), "req_s": round(len(ttfts) / wall, 3),
            "ttft_p50_ms": round(float(np.percentile(arr, 50)), 1), "ttft_p99_ms": round(float(np.percentile(arr, 99)), 1),
            "errors": sorted(set(errors))[:3]}

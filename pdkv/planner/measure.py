"""Measuring a profile against running engines (I/O): OpenAI /v1/completions, /metrics, /v1/models, /version.

P is asked for one token per prompt, in bursts of `concurrency` distinct
prompts of `prompt_tokens` sent at once: each burst's makespan is one
observation of the prefill curve. D is given `batch` streamed completions of
`output_tokens` each over prompts of `context_tokens`, started together and
decoding side by side; each stream's mean gap between tokens after its first
is its ITL, and D's /metrics is polled meanwhile for its KV usage and running
count. Prompts are random token ids, so no two share a prefix block and
the prefix cache never shortens a prefill; `ignore_eos` holds every output
at its length.

D's ITL is read from D itself: the growth of its `vllm:inter_token_latency_seconds`
histogram over the run (sum over count), stamped by the engine core as each
token is made; and so is the batch it ran at, tokens generated over engine
steps taken (`vllm:generation_tokens_total` over `vllm:iteration_tokens_total`'s
count), since a client that cannot start its streams at once (a busy host)
leaves D running fewer side by side than it asked for. The client's gaps are kept too, but a busy API server hands
tokens to the client in bursts (on a 2-core host, a hundred tokens within a
millisecond after a pause), so they measure delivery, not decoding.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import msgspec

from pdkv.engine_api import AsyncEngineClient, EngineMetrics
from pdkv.errors import RemoteError, UnreachableError, UsageError
from pdkv.planner.profile import (
    PROFILE_VERSION,
    DecodeRun,
    Hardware,
    ModelInfo,
    PrefillBurst,
    Profile,
    fits_from,
)

# Token ids prompts are drawn from: ordinary vocabulary in every tokenizer pdkv serves (the tiny model has 2,048 ids;
# special tokens sit at the ends of real vocabularies).
TOKEN_IDS = range(100, 1000)
METRICS_POLL_S = 0.1

Progress = Callable[[int, int, str], None]  # (steps done, steps in all, what is running)


class ProfileSettings(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: tuple[int, ...] = (128, 512, 1024, 2048)
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    batches: tuple[int, ...] = (1, 4, 16, 32)
    context_tokens: tuple[int, ...] = (128, 1024)
    output_tokens: int = 64
    repeats: int = 2
    timeout_s: float = 300.0
    seed: int = 0
    hardware: str | None = None
    kv_bytes_per_token: int | None = None

    def steps(self) -> int:
        return 1 + len(self.prompt_tokens) * len(self.concurrency) * self.repeats + len(self.batches) * len(self.context_tokens)


def _check(settings: ProfileSettings, max_model_len: int | None) -> None:
    for name in ("prompt_tokens", "concurrency", "batches", "context_tokens"):
        values = getattr(settings, name)
        if not values or any(v <= 0 for v in values):
            raise UsageError(f"profile {name.replace('_', '-')} needs positive values, got {values}")
    if settings.output_tokens < 2 or settings.repeats < 1:
        raise UsageError("profile needs --output-tokens >= 2 (ITL is a gap between tokens) and --repeats >= 1")
    if max_model_len is not None:
        longest = max(max(settings.prompt_tokens) + 1, max(settings.context_tokens) + settings.output_tokens)
        if longest > max_model_len:
            raise UsageError(f"a request of {longest} tokens does not fit the engine's max_model_len {max_model_len}",
                             hint="lower --prompt-tokens / --context-tokens / --output-tokens")


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.choice(TOKEN_IDS) for _ in range(tokens)]


async def _get_json(client, url: str) -> dict:
    import httpx

    try:
        r = await client.get(url)
    except httpx.HTTPError as exc:
        raise UnreachableError(f"{url}: {exc.__class__.__name__}", hint="is the engine up? (pdkv status)") from None
    if r.status_code != 200:
        raise RemoteError(f"{url} answered {r.status_code}", status=r.status_code)
    return r.json()


async def engine_model(client, url: str) -> tuple[str, int | None, str | None]:
    """(served model id, max_model_len, vLLM version or None) of one engine."""
    models = (await _get_json(client, f"{url}/v1/models")).get("data") or []
    if not models:
        raise RemoteError(f"{url}/v1/models lists no model")
    version = None
    try:
        version = (await _get_json(client, f"{url}/version")).get("version")
    except (RemoteError, UnreachableError):
        pass
    return str(models[0]["id"]), models[0].get("max_model_len"), version


class Scrape(msgspec.Struct, frozen=True):
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    itl_sum_s: float = 0.0  # vllm:inter_token_latency_seconds, over every engine core
    itl_count: float = 0.0
    steps: float = 0.0  # vllm:iteration_tokens_total's count: engine steps taken
    generated: float = 0.0  # vllm:generation_tokens_total
    engine_s: float = 0.0  # vllm:request_queue_time_seconds + vllm:request_prefill_time_seconds, sums: P's own time
    engine_count: float = 0.0  # requests in that sum (vllm:request_prefill_time_seconds_count)

    def since(self, before: Scrape) -> tuple[float, float, float]:
        """Between `before` and this scrape of one engine: its own time (ms, queue and prefill, summed over requests),
        the requests it answered, and the forwards it took."""
        return (self.engine_s - before.engine_s) * 1e3, self.engine_count - before.engine_count, self.steps - before.steps


SCRAPE_NAMES = (
    "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:iteration_tokens_total_count", "vllm:generation_tokens_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count",
    "vllm:cache_config_info",
)
METRICS_TIMEOUT_S = 30.0


def scrape_of(m: EngineMetrics) -> Scrape:
    """The few vLLM series a profile needs, from one scrape of an engine's /metrics."""
    block_size = blocks = None
    for labels in m.labels("vllm:cache_config_info"):
        if labels.get("block_size", "").isdigit():
            block_size = int(labels["block_size"])
        if labels.get("num_gpu_blocks", "").isdigit():
            blocks = int(labels["num_gpu_blocks"])
    return Scrape(running=m.total("vllm:num_requests_running"), kv_usage=m.highest("vllm:kv_cache_usage_perc"),
                  block_size=block_size, num_blocks=blocks, itl_sum_s=m.total("vllm:inter_token_latency_seconds_sum"),
                  itl_count=m.total("vllm:inter_token_latency_seconds_count"), steps=m.total("vllm:iteration_tokens_total_count"),
                  generated=m.total("vllm:generation_tokens_total"),
                  engine_s=m.total("vllm:request_queue_time_seconds_sum") + m.total("vllm:request_prefill_time_seconds_sum"),
                  engine_count=m.total("vllm:request_prefill_time_seconds_count"))  # fmt: skip


def parse_scrape(text: str) -> Scrape:
    """The few vLLM series a profile needs, from an engine's /metrics text."""
    return scrape_of(EngineMetrics.parse(text, SCRAPE_NAMES))


async def scrape(client, url: str) -> Scrape:
    """One scrape of the engine at `url` through its client (over `client`'s connections)."""
    engine = AsyncEngineClient(url, timeout=METRICS_TIMEOUT_S, http=client)
    return scrape_of(await engine.metrics(SCRAPE_NAMES))


async def _complete(client, url: str, model: str, prompt: list[int], timeout_s: float) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise RemoteError(f"{url} answered {r.status_code} to a prefill: {r.text[:200]}", status=r.status_code)
    return (time.perf_counter() - t0) * 1e3


async def prefill_burst(client, url: str, model: str, rng: random.Random, tokens: int, concurrency: int,
                        timeout_s: float) -> PrefillBurst:  # fmt: skip
    prompts = [_prompt(rng, tokens) for _ in range(concurrency)]
    try:
        before: Scrape | None = await scrape(client, url)
    except (UnreachableError, RemoteError):
        before = None
    t0 = time.perf_counter()
    latencies = await asyncio.gather(*(_complete(client, url, model, p, timeout_s) for p in prompts))
    makespan = round((time.perf_counter() - t0) * 1e3, 3)
    engine_ms, steps = await _engine_share(client, url, before, concurrency)
    return PrefillBurst(tokens, concurrency, [round(v, 3) for v in latencies], makespan, engine_ms, steps)


async def _engine_share(client, url: str, before: Scrape | None, requests: int) -> tuple[float | None, int | None]:
    """P's own time for the `requests` just answered and the forwards it took for them (PrefillBurst.engine_ms and
    engine_steps); None when its /metrics does not say. The engine records a request's times as its answer is made,
    so a scrape right after it may miss the last one: a few more are allowed for."""
    if before is None:
        return None, None
    for _ in range(5):
        try:
            after = await scrape(client, url)
        except (UnreachableError, RemoteError):
            return None, None
        own_ms, answered, forwards = after.since(before)
        if answered >= requests:
            return round(own_ms, 3), int(forwards) if forwards > 0 else None
        await asyncio.sleep(0.02)
    return None, None


async def _stream(client, url: str, model: str, prompt: list[int], tokens: int, timeout_s: float) -> float | None:
    """One streamed completion; its mean gap between tokens after the first (ms), None if under two tokens came."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise RemoteError(f"{url} answered {r.status_code} to a decode stream", status=r.status_code)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            # One event per token; its text may be empty (a byte-level token that ends no character yet).
            if json.loads(line[6:]).get("choices"):
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        return None
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


async def decode_run(client, url: str, model: str, rng: random.Random, batch: int, context: int, output: int,
                     timeout_s: float) -> DecodeRun:  # fmt: skip
    peak = [0.0, 0.0]  # running, kv usage; owned by the poll task until the run ends
    done = asyncio.Event()

    async def poll() -> None:
        while not done.is_set():
            try:
                s = await scrape(client, url)
                peak[0], peak[1] = max(peak[0], s.running), max(peak[1], s.kv_usage)
            except (UnreachableError, RemoteError):  # a missed scrape only leaves the peak lower
                pass
            try:
                await asyncio.wait_for(done.wait(), METRICS_POLL_S)
            except TimeoutError:
                pass

    before = await scrape(client, url)
    poller = asyncio.create_task(poll())
    try:
        itl = await asyncio.gather(*(_stream(client, url, model, _prompt(rng, context), output, timeout_s) for _ in range(batch)))
    finally:
        done.set()
        await poller
    after = await scrape(client, url)
    tokens = after.itl_count - before.itl_count
    engine_itl = (after.itl_sum_s - before.itl_sum_s) / tokens * 1e3 if tokens > 0 else None
    steps = after.steps - before.steps
    mean_batch = (after.generated - before.generated) / steps if steps > 0 else None
    return DecodeRun(batch, context, output, [round(v, 4) for v in itl if v is not None], round(peak[1], 6), int(peak[0]),
                     None if engine_itl is None else round(engine_itl, 4),
                     None if mean_batch is None else round(mean_batch, 3))  # fmt: skip


def detect_hardware(description: str | None, vllm_version: str | None) -> Hardware:
    gpus: list[str] = []
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=10).stdout  # fmt: skip
            gpus = [g.strip() for g in out.splitlines() if g.strip()]
        except (OSError, subprocess.SubprocessError):
            gpus = []
    cpus = os.cpu_count() or 0
    detected = f"{', '.join(gpus)}" if gpus else f"{cpus} CPU cores ({platform.machine()})"
    return Hardware(description=description or detected, host=socket.gethostname(), cpus=cpus,
                    platform=platform.platform(), gpus=gpus, vllm_version=vllm_version)  # fmt: skip


async def measure_profile(prefill_url: str, decode_url: str, settings: ProfileSettings, progress: Progress | None = None) -> Profile:
    """Measure P's prefill curve and D's decode curve on running engines and fit both (see the module's docstring)."""
    import httpx

    step = [0]
    total = settings.steps()

    def tick(what: str) -> None:
        step[0] += 1
        if progress is not None:
            progress(step[0], total, what)

    rng = random.Random(settings.seed)
    limits = httpx.Limits(max_connections=max(64, *settings.batches, *settings.concurrency) + 8)
    async with httpx.AsyncClient(timeout=settings.timeout_s, limits=limits) as client:
        model, max_len, version = await engine_model(client, prefill_url)
        d_model, d_max_len, _ = await engine_model(client, decode_url)
        if d_model != model:
            raise UsageError(f"P serves {model!r} but D serves {d_model!r}", hint="profile a P and a D of one deployment")
        _check(settings, min(v for v in (max_len, d_max_len, 1 << 30) if v))
        # Warm-up: a fresh engine's first forwards of a shape pay for compilation, autotuning and allocation (on an
        # H200 the first bursts of short prompts came out slower than the later ones of prompts four times as long):
        # each prompt length once, at the highest concurrency, before any is measured.
        for tokens in settings.prompt_tokens:
            await prefill_burst(client, prefill_url, model, rng, tokens, max(settings.concurrency), settings.timeout_s)
        await decode_run(client, decode_url, model, rng, 1, min(settings.context_tokens), 2, settings.timeout_s)
        tick("warm-up")
        bursts = []
        for tokens in settings.prompt_tokens:
            for conc in settings.concurrency:
                for _ in range(settings.repeats):
                    bursts.append(await prefill_burst(client, prefill_url, model, rng, tokens, conc, settings.timeout_s))
                    tick(f"prefill {tokens} tokens x {conc}")
        runs = []
        for context in settings.context_tokens:
            for batch in settings.batches:
                runs.append(await decode_run(client, decode_url, model, rng, batch, context, settings.output_tokens,
                                             settings.timeout_s))  # fmt: skip
                tick(f"decode batch {batch}, context {context}")
        cache = await scrape(client, decode_url)
    prefill_fit, decode_fit = fits_from(bursts, runs)
    capacity = cache.block_size * cache.num_blocks if cache.block_size and cache.num_blocks else None
    info = ModelInfo(name=model, max_model_len=max_len, block_size=cache.block_size, kv_capacity_tokens=capacity,
                     kv_bytes_per_token=settings.kv_bytes_per_token)  # fmt: skip
    return Profile(version=PROFILE_VERSION, created=datetime.now(UTC).isoformat(timespec="seconds"), model=info,
                   hardware=detect_hardware(settings.hardware, version), prefill_url=prefill_url, decode_url=decode_url,
                   prefill=bursts, decode=runs, prefill_fit=prefill_fit, decode_fit=decode_fit)  # fmt: skip


def run_profile(prefill_url: str, decode_url: str | None, settings: ProfileSettings, progress: Progress | None = None) -> Profile:
    """Synchronous entry: measure a profile (D defaults to P's URL: one engine measured in both roles)."""
    urls: Sequence[str] = [prefill_url.rstrip("/"), (decode_url or prefill_url).rstrip("/")]
    return asyncio.run(measure_profile(urls[0], urls[1], settings, progress))

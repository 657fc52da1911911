"""Tracing live requests: send one through the proxy, gather every side's record, assemble the Trace.

`run_trace(proxy_url, ...)` is the whole job for one request (what `pdkv up`
calls once it is ready); `TraceSession` keeps the discovery (backends,
model, prompt) for repeated requests. Records come from:

- the proxy: `GET /pdkv/requests/{request_id}` (pdkv.proxy_api.ProxyTiming);
- P's connector: a StatsQuery on every prefill worker's side channel, whose
  addresses the bootstrap server lists (D's events reach P after D's first
  token, so the query is repeated, bounded, until they are there);
- the client: the request is streamed, so its first token's arrival is TTFT.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pdkv.engine_api import CompletionTokenize, EngineClient
from pdkv.errors import PdkvError, RemoteError, UnreachableError, UsageError
from pdkv.proxy_api import BackendHealth, ProxyClient, ProxyTiming
from pdkv.wire import StatsReply, TransferTrace, query_stats
from pdkv.trace.assemble import assemble, summarize
from pdkv.trace.model import ClientTiming, Trace, TraceResult

Progress = Callable[[str], None]
LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}
TOKENS_PER_WORD_GUESS = 1.3


def _host(url: str) -> str:
    return urlsplit(url).hostname or ""


def one_host(proxy_url: str, backend_urls: list[str]) -> bool:
    """True when the proxy and every backend it names run on one host (one clock)."""
    proxy_host = _host(proxy_url)
    hosts = {proxy_host if _host(u) in LOOPBACK else _host(u) for u in backend_urls if u}
    hosts.add(proxy_host)
    return len(hosts) == 1 or all(h in LOOPBACK for h in hosts)


async def _stats(addr: str, since: float, timeout: float) -> StatsReply | str:
    """One P worker's StatsReply, or why there is none."""
    try:
        return await query_stats(addr, since=since, limit=1000, timeout=timeout)
    except PdkvError as exc:
        return exc.message


class TraceSession:
    """Discovery done once (proxy health, model, backends, prompt); `once()` traces one request.

    A context manager; every network wait is bounded by `timeout` (the request itself) or a few seconds.
    """

    def __init__(
        self,
        proxy_url: str,
        *,
        prompt_tokens: int = 1000,
        prompt: str | None = None,
        max_tokens: int = 128,
        link_gbps: float = 400.0,
        bootstrap_url: str | None = None,
        timeout: float = 300.0,
        connector_wait_s: float = 5.0,
        progress: Progress | None = None,
        admin_key: str | None = None,
        api_key: str | None = None,
    ) -> None:
        """`admin_key` (default: env PDKV_ADMIN_KEY) for the proxy's /pdkv/*; `api_key` (default: the first
        of env PDKV_API_KEY) for its /v1/*."""
        if prompt is None and prompt_tokens < 1:
            raise UsageError(f"--prompt-tokens must be at least 1, got {prompt_tokens}")
        if max_tokens < 1:
            raise UsageError(f"--max-tokens must be at least 1, got {max_tokens}")
        if link_gbps <= 0:
            raise UsageError(f"--link-gbps must be positive, got {link_gbps}")
        self.proxy_url = proxy_url.rstrip("/")
        self.max_tokens, self.link_gbps, self.timeout = max_tokens, link_gbps, timeout
        self.connector_wait_s = connector_wait_s
        self.progress = progress or (lambda _msg: None)
        self.client = ProxyClient(self.proxy_url, timeout=10.0, admin_key=admin_key, api_key=api_key)
        try:
            self.prefills, self.decodes = self._backends()
            self.bootstrap_override = bootstrap_url
            self.model = self._model()
            self.requested_tokens = None if prompt is not None else prompt_tokens
            self.prompt = prompt if prompt is not None else self._build_prompt(prompt_tokens)
            self.runs = 0
        except BaseException:
            self.client.close()
            raise

    # --- discovery ---------------------------------------------------------------

    def _backends(self) -> tuple[list[BackendHealth], list[BackendHealth]]:
        self.progress("asking the proxy for its backends")
        health = self.client.health()
        if health.status != "ok":
            raise RemoteError(f"the proxy is not ready: {health.reason}", status=503,
                              hint="wait until `pdkv status` shows every part ready")
        return health.of_role("prefill"), health.of_role("decode")

    def _model(self) -> str:
        models = self.client.models()
        if not models:
            raise RemoteError(f"the proxy's /v1/models lists no model ({self.proxy_url})")
        return models[0]

    def _count_tokens(self, text: str) -> int | None:
        """Tokens `text` makes for the served model: a backend's /tokenize, else a local tokenizer.json."""
        for b in self.decodes + self.prefills:
            try:
                with EngineClient(b.url, timeout=10.0) as engine:
                    answer = engine.tokenize(CompletionTokenize(text, model=self.model))
            except (UnreachableError, RemoteError):
                continue
            return answer.count if answer.count is not None else len(answer.tokens)
        tok = Path(self.model) / "tokenizer.json"
        if tok.is_file():
            try:
                from tokenizers import Tokenizer
            except ImportError:
                return None
            return len(Tokenizer.from_file(str(tok)).encode(text).ids)
        return None

    def _build_prompt(self, n: int) -> str:
        """Text of about `n` tokens: words scaled by the measured tokens per word, refined a few times."""
        from pdkv.tinymodel import sample_text

        self.progress(f"building a prompt of about {n} tokens")
        words = max(1, round(n / TOKENS_PER_WORD_GUESS))
        text = sample_text(words, seed=n)
        self._words = words
        for _ in range(5):
            count = self._count_tokens(text)
            if count is None or abs(count - n) <= max(1, n // 100):
                break
            words = max(1, round(words * n / max(count, 1)) + (1 if count < n else -1))
            text = sample_text(words, seed=n)
            self._words = words
        return text

    # --- one request ---------------------------------------------------------------

    def _send(self, request_id: str) -> ClientTiming:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        sent, t0 = time.time(), time.perf_counter()
        first: float | None = None
        usage: dict[str, Any] = {}
        for event in self.client.stream_completion(body, request_id=request_id, timeout=self.timeout):
            if event.get("choices") and first is None:
                first = time.perf_counter()
            if event.get("usage"):
                usage = event["usage"]
        done = time.perf_counter()
        return ClientTiming(sent=sent, first_token=sent + (first - t0) if first is not None else None, done=sent + (done - t0),
                            prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"))

    def _proxy_record(self, request_id: str) -> ProxyTiming:
        deadline = time.monotonic() + 5.0
        while True:
            timing = self.client.request(request_id)
            if timing is not None and (timing.last_byte is not None or time.monotonic() > deadline):
                return timing
            if timing is None and time.monotonic() > deadline:
                raise RemoteError(f"the proxy has no record of request {request_id} (404)", status=404,
                                  hint="pdkv trace needs pdkv's proxy, which records per-request timings")
            time.sleep(0.05)

    def _bootstrap_for(self, prefill_url: str) -> str | None:
        if self.bootstrap_override:
            return self.bootstrap_override
        for b in self.prefills:
            if b.url == prefill_url and b.bootstrap:
                return str(b.bootstrap)
        return None

    def _connector_records(self, timing: ProxyTiming) -> tuple[list[TransferTrace], str]:
        """P's connector records for this transfer, waited for (bounded) until D's events are in them."""
        from pdkv.bootstrap import BootstrapClient

        bootstrap = self._bootstrap_for(timing.prefill_url)
        if bootstrap is None:
            return [], "connector-side steps are not visible: the proxy names no bootstrap server for P"
        try:
            with BootstrapClient(bootstrap, timeout=2.0, retries=1) as bs:
                engines = bs.query()
        except Exception as exc:  # noqa: BLE001 - any failure here only hides the connector's half
            return [], f"connector-side steps are not visible: bootstrap {bootstrap} did not answer ({exc})"
        rank = str(timing.prefill_dp_rank) if timing.prefill_dp_rank is not None else None
        addrs = [a for dp, e in engines.items() if rank is None or str(dp) == rank
                 for pps in e.worker_addr.values() for a in pps.values()]
        since = timing.received - 300.0  # generous: P's clock may differ from the proxy's
        deadline = time.monotonic() + self.connector_wait_s
        while True:
            replies = asyncio.run(self._gather(addrs, since))
            why = next((r for r in replies if isinstance(r, str)), "")
            if why:
                return [], f"connector-side steps are not visible: {why}"
            records = [t for r in replies if isinstance(r, StatsReply) for t in r.traces if t.transfer_id == timing.transfer_id]
            complete = records and all("first_token_scheduled" in t.events and t.status for t in records)
            if complete or time.monotonic() > deadline:
                if not records:
                    return [], f"P's connector has no record of {timing.transfer_id}"
                return records, ""
            time.sleep(0.05)

    @staticmethod
    async def _gather(addrs: list[str], since: float) -> list[StatsReply | str]:
        return list(await asyncio.gather(*(_stats(a, since, 2.0) for a in addrs)))

    def once(self, request_id: str | None = None) -> Trace:
        """Send one request through the proxy and return its assembled Trace."""
        request_id = request_id or f"trace-{uuid.uuid4().hex[:16]}"
        if self.runs and self.requested_tokens is not None:
            # A new text of the same length each run: a repeated prompt would hit P's and D's prefix caches
            # and move only its uncached tail.
            from pdkv.tinymodel import sample_text

            self.prompt = sample_text(self._words, seed=self.requested_tokens + 7919 * self.runs)
        self.runs += 1
        self.progress(f"sending {request_id}")
        client = self._send(request_id)
        self.progress("collecting the proxy's and the connector's records")
        timing = self._proxy_record(request_id)
        records, why = self._connector_records(timing)
        backend_urls = [timing.prefill_url, timing.decode_url] + [x.bootstrap or "" for x in self.prefills]
        return assemble(timing, records, client, link_gbps=self.link_gbps,
                        one_host=one_host(self.proxy_url, backend_urls), model=self.model,
                        requested_prompt_tokens=self.requested_tokens, connector_note=why)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> TraceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_trace(proxy_url: str, **kw: Any) -> Trace:
    """Trace one request through the pdkv proxy at `proxy_url` (keywords as TraceSession's)."""
    with TraceSession(proxy_url, **kw) as session:
        return session.once()


def run_traces(proxy_url: str, repeat: int = 1, **kw: Any) -> TraceResult:
    """`repeat` requests one after another; the summary (p50/p90 per phase) when there is more than one."""
    if repeat < 1:
        raise UsageError(f"--repeat must be at least 1, got {repeat}")
    progress: Progress = kw.get("progress") or (lambda _m: None)
    with TraceSession(proxy_url, **kw) as session:
        traces = []
        for i in range(repeat):
            progress(f"request {i + 1} of {repeat}")
            traces.append(session.once())
    return TraceResult(traces=traces, summary=summarize(traces) if repeat > 1 else None)

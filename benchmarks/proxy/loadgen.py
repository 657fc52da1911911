"""A closed-loop load generator for OpenAI completions, on raw asyncio + httptools.

`concurrency` workers, each on its own keep-alive connection, send streaming
/v1/completions requests back to back for `duration` seconds (after `warmup`).
Time to first byte (TTFB) is measured from writing the request to the first
byte of the response body. Prints one JSON line:
{"concurrency", "requests", "all_requests" (warm-up included), "errors", "duration_s", "rps", "ttfb_p50_ms", "ttfb_p99_ms",
"latency_p50_ms"}.

Run: python benchmarks/proxy/loadgen.py --url http://127.0.0.1:8000 --concurrency 32 --duration 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from urllib.parse import urlsplit

import httptools

BODY = json.dumps(
    {
        "model": "stub",
        "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
        "max_tokens": 8,
        "stream": True,
        "stop": ["\n\n", "###"],
        "stop_token_ids": [151645],
        "temperature": 0.0,
    },
    separators=(",", ":"),
).encode()


class Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.first: asyncio.Future | None = None
        self.done: asyncio.Future | None = None
        self.status = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        for fut in (self.first, self.done):
            if fut is not None and not fut.done():
                fut.set_exception(ConnectionError("connection lost"))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.first is not None and not self.first.done():
            self.first.set_result(time.perf_counter())

    def on_message_complete(self) -> None:
        if self.first is not None and not self.first.done():
            self.first.set_result(time.perf_counter())
        if self.done is not None and not self.done.done():
            self.done.set_result(time.perf_counter())


async def worker(host: str, port: int, request: bytes, stop_at: float, record_from: float, out: dict) -> None:
    loop = asyncio.get_running_loop()
    conn: Conn | None = None
    while True:
        now = time.perf_counter()
        if now >= stop_at:
            break
        if conn is None or conn.transport.is_closing():
            _, conn = await loop.create_connection(Conn, host, port)
        conn.first = loop.create_future()
        conn.done = loop.create_future()
        t0 = time.perf_counter()
        conn.transport.write(request)
        try:
            first = await asyncio.wait_for(conn.first, 30)
            end = await asyncio.wait_for(conn.done, 30)
        except (ConnectionError, asyncio.TimeoutError):
            if t0 >= record_from:
                out["errors"] += 1
            conn.transport.close()
            conn = None
            continue
        out["all"] += 1
        if t0 >= record_from and end <= stop_at:
            if conn.status == 200:
                out["ttfb"].append(first - t0)
                out["lat"].append(end - t0)
            else:
                out["errors"] += 1
    if conn is not None:
        conn.transport.close()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(url: str, concurrency: int, duration: float, warmup: float, path: str) -> dict:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = (
        b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % (path.encode(), host.encode(), port, len(BODY))
        + BODY
    )
    out: dict = {"ttfb": [], "lat": [], "errors": 0, "all": 0}
    start = time.perf_counter()
    record_from = start + warmup
    stop_at = record_from + duration
    await asyncio.gather(*(worker(host, port, request, stop_at, record_from, out) for _ in range(concurrency)))
    n = len(out["ttfb"])
    return {
        "concurrency": concurrency,
        "requests": n,
        "all_requests": out["all"],
        "errors": out["errors"],
        "duration_s": duration,
        "rps": n / duration,
        "ttfb_p50_ms": percentile(out["ttfb"], 0.50) * 1000,
        "ttfb_p99_ms": percentile(out["ttfb"], 0.99) * 1000,
        "latency_p50_ms": percentile(out["lat"], 0.50) * 1000,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--path", default="/v1/completions")
    args = ap.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    result = asyncio.run(run(args.url, args.concurrency, args.duration, args.warmup, args.path))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

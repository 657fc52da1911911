"""Load test of a bootstrap server's GET /query: many concurrent clients on loopback.

Starts `pdkv bootstrap` in its own process (or uses --url), registers a
registry of --dp x --tp workers, then runs --clients concurrent clients that
each send --requests GET /query one after another, and reports latency
percentiles. Every answer is checked against the registry registered.

    python benchmarks/bootstrap_query.py                      # 200 clients, keep-alive
    python benchmarks/bootstrap_query.py --new-connection     # a TCP connect per query, as vLLM's D does
    python benchmarks/bootstrap_query.py --interval-ms 50     # each client paced to one query per 50 ms
    python benchmarks/bootstrap_query.py --url http://10.0.0.2:8998 --json

Exit status 1 if p99 exceeds --target-p99-ms (default 50 ms).

The clients speak HTTP/1.1 over raw asyncio streams so that the client's own
overhead stays small beside the server's (both share this machine's cores).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import msgspec
import psutil

from pdkv.bootstrap import BootstrapClient
from pdkv.wire import RegisterRequest


class Result(msgspec.Struct):
    url: str
    clients: int
    requests: int
    errors: int
    new_connection: bool
    interval_ms: float
    workers_registered: int
    body_bytes: int
    seconds: float
    per_second: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    server_cpu_us_per_query: float | None
    target_p99_ms: float
    ok: bool


@contextlib.contextmanager
def local_server() -> Iterator[tuple[str, int]]:
    """`pdkv bootstrap` on a free loopback port in a child process; yields (URL, pid)."""
    cmd = [sys.executable, "-m", "pdkv", "bootstrap", "--port", "0", "--json", "--quiet", "--probe-interval", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout=20):
                raise SystemExit("pdkv bootstrap did not start within 20 s")
        yield json.loads(proc.stdout.readline())["url"], proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def populate(url: str, dp: int, tp: int) -> bytes:
    """Register dp x tp workers; return the /query body every answer must equal."""
    with BootstrapClient(url) as client:
        for d in range(dp):
            for t in range(tp):
                client.register(RegisterRequest(f"bench-engine-{d}", d, t, 0, f"tcp://10.0.{d}.{t + 1}:{41000 + t}"))
        return client._http.get("/query").content


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, body, headers.get("connection", "").lower() == "close"


async def one_client(
    host: str, port: int, n: int, expected: bytes, new_connection: bool, interval: float, start: asyncio.Event, latencies: list[float]
) -> int:
    request = f"GET /query HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    errors = 0
    reader = writer = None
    await start.wait()
    if interval:
        await asyncio.sleep(random.uniform(0, interval))  # spread the clients over one interval
    next_at = time.perf_counter()
    for _ in range(n):
        if interval:
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        t0 = time.perf_counter()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            status, body, close = await _read_response(reader)
            latencies.append(time.perf_counter() - t0)
            if status != 200 or body != expected:
                errors += 1
            if close or new_connection:
                writer.close()
                writer = None
        except (OSError, asyncio.IncompleteReadError, ValueError):
            errors += 1
            if writer is not None:
                writer.close()
            writer = None
    if writer is not None:
        writer.close()
    return errors


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


async def load(
    url: str, clients: int, requests: int, expected: bytes, new_connection: bool, interval: float
) -> tuple[list[float], int, float]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    start = asyncio.Event()
    latencies: list[float] = []
    tasks = [
        asyncio.create_task(one_client(host, port, requests, expected, new_connection, interval, start, latencies))
        for _ in range(clients)
    ]
    await asyncio.sleep(0.05)  # every client waits on the start line
    t0 = time.perf_counter()
    start.set()
    errors = sum(await asyncio.gather(*tasks))
    return latencies, errors, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an already running bootstrap server (default: start one on loopback)")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--requests", type=int, default=50, help="queries per client")
    parser.add_argument("--dp", type=int, default=4, help="DP ranks to register")
    parser.add_argument("--tp", type=int, default=8, help="TP ranks per DP rank")
    parser.add_argument("--new-connection", action="store_true", help="open a TCP connection per query")
    parser.add_argument("--interval-ms", type=float, default=0.0, help="pace each client to one query per interval (0: back to back)")
    parser.add_argument("--target-p99-ms", type=float, default=50.0)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)

    with contextlib.ExitStack() as stack:
        url, pid = (args.url, None) if args.url else stack.enter_context(local_server())
        expected = populate(url, args.dp, args.tp)
        server = psutil.Process(pid) if pid else None
        cpu_before = sum(server.cpu_times()[:2]) if server else 0.0
        latencies, errors, seconds = asyncio.run(
            load(url, args.clients, args.requests, expected, args.new_connection, args.interval_ms / 1000)
        )
        cpu_used = sum(server.cpu_times()[:2]) - cpu_before if server else None
    ms = sorted(x * 1000 for x in latencies)
    total = args.clients * args.requests
    result = Result(
        url=url,
        clients=args.clients,
        requests=total,
        errors=errors,
        new_connection=args.new_connection,
        interval_ms=args.interval_ms,
        workers_registered=args.dp * args.tp,
        body_bytes=len(expected),
        seconds=round(seconds, 3),
        per_second=round(total / seconds, 1),
        p50_ms=round(percentile(ms, 50), 2),
        p90_ms=round(percentile(ms, 90), 2),
        p99_ms=round(percentile(ms, 99), 2),
        max_ms=round(ms[-1], 2) if ms else float("nan"),
        server_cpu_us_per_query=round(cpu_used / total * 1e6, 1) if cpu_used is not None else None,
        target_p99_ms=args.target_p99_ms,
        ok=errors == 0 and percentile(ms, 99) <= args.target_p99_ms,
    )
    if args.json:
        print(msgspec.json.encode(result).decode())
    else:
        mode = "new connection per query" if args.new_connection else "keep-alive"
        mode += f", one query per {args.interval_ms:g} ms per client" if args.interval_ms else ", back to back"
        print(f"bootstrap /query at {url}: {args.clients} concurrent clients x {args.requests} queries ({mode}), "
              f"{result.workers_registered} workers registered ({result.body_bytes} B answer)")
        print(f"  {total} queries in {result.seconds} s = {result.per_second:,.0f}/s, errors {errors}")
        print(f"  latency p50 {result.p50_ms} ms  p90 {result.p90_ms} ms  p99 {result.p99_ms} ms  max {result.max_ms} ms")
        if result.server_cpu_us_per_query is not None:
            print(f"  server CPU {result.server_cpu_us_per_query} us per query")
        print(f"  p99 target {args.target_p99_ms:g} ms: {'met' if result.ok else 'MISSED'}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""Run inside host A's namespace by test_fleet.py's fault tests: streams in flight while a host's link is cut.

    python3 fault_client.py PROXY_URL N MAX_TOKENS

Talks JSON lines: it starts N streaming completions and prints {"event": "streaming"} once every stream has
its first token; then it waits for a line on stdin (the link was cut), and prints {"event": "ended",
"results": [...]} with, for each stream, how long after that line it ended and how (completed, an error
event's message, or the connection's error). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

BOUND_S = 120.0


async def stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, first: asyncio.Event, out: dict) -> None:
    body = {"model": "tiny", "prompt": f"stream {i}: the river runs north to the city", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    out.update(tokens=0, error=None, completed=False)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            out["status"] = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["completed"] = out["error"] is None
                    break
                event = json.loads(data)
                if "error" in event:
                    out["error"] = event["error"].get("message", str(event["error"]))
                    continue
                out["tokens"] += 1
                first.set()
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["ended_at"] = time.monotonic()


async def main() -> None:
    url, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    results = [{} for _ in range(n)]
    firsts = [asyncio.Event() for _ in range(n)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(BOUND_S), trust_env=False) as client:
        tasks = [asyncio.create_task(stream(client, url, i, max_tokens, firsts[i], results[i])) for i in range(n)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 90)
        print(json.dumps({"event": "streaming", "tokens": [r["tokens"] for r in results]}), flush=True)
        await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline), 60)
        cut = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)
    for r in results:
        r["after_cut_s"] = round(r.pop("ended_at") - cut, 3)
    print(json.dumps({"event": "ended", "results": results}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())

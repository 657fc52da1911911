"""Run inside host A's namespace by test_fleet.py's membership test: N answers through the proxy and from P alone,
and which decode server the proxy sent each one to.

    python3 join_client.py PROXY_URL PREFILL_URL N SEED   -> one JSON document on stdout
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script in a namespace: tests/ for support

from support.loadclient import Case, one  # noqa: E402


async def main() -> None:
    proxy, prefill, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cases = [Case("/v1/completions", f"turn {seed}-{i}: the river runs north to the city of {i * 7 + seed}", i % 2 == 0)
             for i in range(n)]
    out = []
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        for case in cases:
            got = await one(client, proxy, case, "tiny", top=5)
            alone = await one(client, prefill, case, "tiny", top=5)
            out.append({"pd": asdict(got), "alone": asdict(alone)})
        records = (await client.get(f"{proxy}/pdkv/requests", params={"limit": n})).json()
    print(json.dumps({"answers": out, "decode_urls": [r.get("decode_url", "") for r in records]}))


if __name__ == "__main__":
    asyncio.run(main())

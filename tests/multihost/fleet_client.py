"""Run inside host A's namespace by test_fleet.py: answers through the proxy and from P alone, one trace, the status.

    python3 fleet_client.py PROXY_URL PREFILL_URL FLEET_FILE MODEL_DIR N [N ...]   -> one JSON document on stdout
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

import httpx
import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script in a namespace: tests/ for support

from support.loadclient import Case, one  # noqa: E402


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(100, vocab - 100, size=n)]


async def answers(proxy: str, prefill: str, cases: list[Case]) -> list[dict]:
    out = []
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        for case in cases:
            alone = await one(client, prefill, case, "tiny", top=5)
            got = await one(client, proxy, case, "tiny", top=5)
            out.append({"n": len(case.prompt), "pd": asdict(got), "alone": asdict(alone)})
    return out


def main() -> None:
    proxy, prefill, fleet, model, *lengths = sys.argv[1:]
    from pdkv.deploy import collect_status, load_deployment, status_targets
    from pdkv.trace import run_trace

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    # Token ids as prompts: exact lengths (the tiny tokenizer would merge words).
    cases = [Case("/v1/completions", prompt_ids(int(n), vocab, 2000 + int(n)), False) for n in lengths]  # type: ignore[arg-type]
    doc: dict = {"answers": asyncio.run(answers(proxy, prefill, cases))}
    trace = run_trace(proxy, prompt_tokens=1000, max_tokens=4, link_gbps=400)
    doc["trace"] = msgspec.to_builtins(trace)
    targets, boots, proxy_url = status_targets(load_deployment(fleet))
    doc["status"] = msgspec.to_builtins(collect_status(proxy_url=proxy_url, targets=targets, bootstraps=boots))
    print(json.dumps(doc))


if __name__ == "__main__":
    main()

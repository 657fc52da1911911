"""Warm-up: short requests through the proxy before a deployment is announced ready.

A P/D pair's first request pays for first contacts that later ones do not:
D asks the bootstrap server where P's workers are, connects its side channel
to P, and the transport makes its first contact with the peer (about 110-170
ms of the first traced request's TTFT on the 2-core CPU host, against a few
ms afterwards). `warm_up` pays them before `pdkv up` says ready, so the
first user request costs what a steady-state one does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdkv.errors import RemoteError, StartError, TimeoutError_, UnreachableError
from pdkv.proxy_api import ProxyClient

if TYPE_CHECKING:
    from pdkv.deploy.plan import Part

WARMUP_PROMPT = "Warm-up: the bootstrap, the side channel and the transport make first contact."
WARMUP_TIMEOUT_S = 120.0


def warm_up_deployment(parts: Sequence[Part], model: str, *, timeout: float = WARMUP_TIMEOUT_S) -> list[float]:
    """Warm a started deployment through its proxy: one request per engine of its larger role (sent one
    after another, the proxy's round-robin reaches every engine). Returns each one's milliseconds; [] without a proxy."""
    proxy = next((p for p in parts if p.kind == "proxy"), None)
    if proxy is None:
        return []
    requests = max(sum(p.kind == "prefill" for p in parts), sum(p.kind == "decode" for p in parts))
    return warm_up(proxy.launch.url, model, requests=max(1, requests), timeout=timeout)


def warm_up(proxy_url: str, model: str, *, requests: int = 1, timeout: float = 60.0) -> list[float]:
    """Send `requests` one-token completions through the proxy at `proxy_url`, one after another.

    Returns each one's milliseconds. Raises StartError (one line: what
    failed, and the proxy's answer) when one fails or `timeout` seconds
    pass for one of them.
    """
    took: list[float] = []
    body = {"model": model, "prompt": WARMUP_PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    with ProxyClient(proxy_url) as proxy:
        for i in range(requests):
            t0 = time.perf_counter()
            try:
                proxy.complete(body, request_id=f"pdkv-warmup-{uuid.uuid4().hex[:12]}", timeout=timeout)
            except TimeoutError_:
                raise StartError(f"warm-up request {i + 1} through {proxy_url} had no answer within {timeout:g} s",
                                 hint="read the prefill and decode logs") from None
            except UnreachableError as exc:
                raise StartError(f"warm-up request {i + 1} through {proxy_url} failed: {exc}", hint="read the proxy's log") from None
            except RemoteError as exc:
                raise StartError(f"warm-up request {i + 1} through {proxy_url} answered {exc.status}: {exc.message.split(': ', 1)[1]}",
                                 hint="read the proxy, prefill and decode logs") from None
            took.append((time.perf_counter() - t0) * 1000.0)
    return took

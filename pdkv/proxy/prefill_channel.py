"""What the proxy asks P's connector (pdkv's) over its workers' side channels: why one transfer failed, and to
let one go that no D will pull.
"""

from __future__ import annotations

import asyncio

from pdkv.proxy_api import ProxyTiming
from pdkv.wire import Release, query_stats, send_once

FATE_TIMEOUT_S = 0.5  # bound on asking P why a failed request's KV did not come


def release_at_prefill(workers: list[str], transfer_id: str, pulls: int, binding: str) -> None:
    """Tell P's workers (one Release per D request that would have pulled) that nobody will pull this transfer,
    off the loop, so that P frees its blocks now instead of after its expiry."""
    if not workers:
        return
    msgs = [Release(transfer_id=transfer_id, d_req_id="", reason="the proxy: decode failed or the client left", binding=binding)
            for _ in range(pulls)]
    loop = asyncio.get_running_loop()
    for addr in workers:
        loop.run_in_executor(None, send_once, addr, msgs)


async def transfer_fate(workers: list[str], t: ProxyTiming) -> str | None:
    """Why request `t`'s KV transfer failed, as P's connector recorded it; None if P does not say (vLLM's
    connector, P unreachable, or the transfer did not fail). Each worker is asked within FATE_TIMEOUT_S."""
    for addr in workers:
        try:
            reply = await query_stats(addr, since=t.received, limit=1000, timeout=FATE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - another protocol, or no answer: nothing to add
            continue
        for rec in reply.traces:
            if rec.transfer_id == t.transfer_id and rec.status not in ("", "sent"):
                return f"KV transfer {rec.transfer_id} {rec.status}" + (f": {rec.error}" if rec.error else "")
    return None

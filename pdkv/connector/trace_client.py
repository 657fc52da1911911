"""Reading the connector's traces and metrics from outside: bootstrap URL in, StatsReply per P worker out.

This is what `pdkv trace` builds on: the bootstrap registry lists every
prefill worker's side channel, and each answers a StatsQuery with its
transfer traces (D's events included, reported back by D) and its
Prometheus-format metrics.
"""

from __future__ import annotations

import asyncio

from pdkv.bootstrap.client import BootstrapClient
from pdkv.connector.side_channel import request_once
from pdkv.errors import RemoteError, UnreachableError
from pdkv.protocol import StatsQuery, StatsReply


def worker_addresses(bootstrap_url: str, timeout: float = 2.0) -> list[str]:
    """Every registered prefill worker's side-channel address."""
    with BootstrapClient(bootstrap_url, timeout=timeout, retries=1) as bs:
        engines = bs.query()
    return [addr for entry in engines.values() for pps in entry.worker_addr.values() for addr in pps.values()]


def fetch_stats(bootstrap_url: str, *, since: float = 0.0, limit: int = 1000, timeout: float = 2.0) -> list[StatsReply]:
    """Ask every prefill worker for its traces since `since`; raise UnreachableError if one does not answer."""

    async def ask(addr: str) -> StatsReply:
        try:
            reply = await request_once(addr, StatsQuery(since=since, limit=limit), timeout)
        except TimeoutError:
            raise UnreachableError(f"prefill worker {addr} did not answer a stats query within {timeout:g} s") from None
        if not isinstance(reply, StatsReply):
            raise RemoteError(f"prefill worker {addr} answered a stats query with {type(reply).__name__}")
        return reply

    async def ask_all() -> list[StatsReply]:
        return list(await asyncio.gather(*(ask(a) for a in worker_addresses(bootstrap_url, timeout))))

    return asyncio.run(ask_all())

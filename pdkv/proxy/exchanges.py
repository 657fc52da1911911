"""The exchanges of one proxied request: P's and D's HTTP answers, and the flight the handler waits on.

`Flight` is poked by either exchange (or the client going away) so the
handler in pdkv.proxy.app re-reads their state; nothing here decides what
to do about it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdkv.proxy_api import ProxyTiming
from pdkv.proxy.http import Exchange, UpstreamError


class Flight:
    """What the handler of one request waits on: either exchange, or the client, pokes it."""

    __slots__ = ("loop", "waiter", "client_gone", "timing")

    def __init__(self, loop: asyncio.AbstractEventLoop, timing: ProxyTiming) -> None:
        self.loop = loop
        self.waiter: asyncio.Future | None = None
        self.client_gone = False
        self.timing = timing

    def poke(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def wait(self) -> asyncio.Future:
        self.waiter = self.loop.create_future()
        return self.waiter


class PrefillExchange(Exchange):
    __slots__ = ("flight", "chunks")

    def __init__(self, flight: Flight) -> None:
        super().__init__()
        self.flight = flight
        self.chunks: list[bytes] = []

    def on_body(self, data: bytes) -> None:
        self.chunks.append(data)

    def on_complete(self) -> None:
        t = self.flight.timing
        t.prefill_responded = time.time()
        t.prefill_status = self.status
        self.flight.poke()

    def on_error(self, error: UpstreamError) -> None:
        self.flight.poke()


class DecodeExchange(Exchange):
    """D's answer: buffered until the handler commits the client response, then written straight through."""

    __slots__ = ("flight", "chunks", "sink", "first", "events")

    def __init__(self, flight: Flight) -> None:
        super().__init__()
        self.flight = flight
        self.chunks: list[bytes] = []
        self.sink: Any = None
        self.first = False
        self.events = 0  # SSE events seen (streamed: about one per output token, and the closing [DONE])

    def on_body(self, data: bytes) -> None:
        self.events += data.count(b"data: ")
        if self.sink is not None:
            self.sink(data)
            return
        self.chunks.append(data)
        if not self.first:
            self.first = True
            self.flight.timing.decode_first_byte = time.time()
            self.clear_deadline()
            self.flight.poke()

    def on_complete(self) -> None:
        self.flight.poke()

    def on_error(self, error: UpstreamError) -> None:
        self.flight.poke()


class LocalPrefill(PrefillExchange):
    """The prefill of a request D computes itself (no P, or P failed before D's KV could come): done from the start."""

    def __init__(self, flight: Flight) -> None:
        super().__init__(flight)
        self.finished = True
        self.status = 200


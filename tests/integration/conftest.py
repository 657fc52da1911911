"""Fixtures of the connector's P/D tests, over support.kv_pair: `kv`, a KVHarness closed after the test, and
`make_pair`, its `pair` (P and D over real ZMQ, a real bootstrap server and a real transport on loopback)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from support.kv_pair import KVHarness, Pair


@pytest.fixture
def kv() -> Iterator[KVHarness]:
    with KVHarness() as harness:
        yield harness


@pytest.fixture
def make_pair(kv: KVHarness) -> Callable[..., Pair]:
    return kv.pair

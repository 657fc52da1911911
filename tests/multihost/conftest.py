"""Fixtures for tests across "hosts": network namespaces joined by a bridge (tests/multihost/netns.py).

- `tiny_model`: the embedded tiny model, written once per session.
- `testbed`: a module-scoped factory, `testbed(["A", "B", "C"])` -> one `NetnsHost` per name
  (namespace, 198.18.0.x address); every process left in them, the namespaces, veths and
  bridge are removed when the module ends, whether its tests passed or not. Skips the test
  with the reason where namespaces cannot be made (not root, no `ip`).

Tests that use it are marked `multihost` (and `e2e` when they start vLLM).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from netns import NetnsHost, TestBed, unavailable


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdkv.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def testbed() -> Iterator[Callable[[list[str]], list[NetnsHost]]]:
    why = unavailable()
    if why:
        pytest.skip(f"multihost test bed: {why}")
    made: list[TestBed] = []

    def make(names: list[str]) -> list[NetnsHost]:
        bed = TestBed(names, first=1 + 10 * len(made))  # a second bed in one module gets other addresses
        made.append(bed)
        return stack.enter_context(bed)

    with contextlib.ExitStack() as stack:
        yield make

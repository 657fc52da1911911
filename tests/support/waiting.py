"""Bounded waits for the tests: every wait ends, with an AssertionError naming what did not happen."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 5.0, interval: float = 0.02) -> bool:
    """True once `predicate()` is true, False if `timeout` s pass first."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition", interval: float = 0.02) -> None:
    """Return once `predicate()` is true; AssertionError naming `what` if `timeout` s pass first."""
    if not wait_until(predicate, timeout, interval):
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def waited_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.5) -> float:
    """Seconds until `predicate()` was true; AssertionError naming `what` if `timeout` s pass first."""
    start = time.monotonic()
    wait_for(predicate, timeout, what, interval)
    return time.monotonic() - start

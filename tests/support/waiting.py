"""Bounded waits for the tests: every wait ends, with an AssertionError naming what did not happen.

`wait_for` polls a predicate; `LogWatch` waits for a log record (what a part says it did, from any thread).
"""

from __future__ import annotations

import logging
import threading
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


class LogWatch(logging.Handler):
    """The records one logger (and its children) emits inside a `with` block, and a bounded wait for one of them.

        with LogWatch("pdkv.connector") as logs:
            sender.close()
            logs.wait("connection to", "lost")      # the record D logs once it saw the connection end
    """

    def __init__(self, logger: str, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self._logger = logging.getLogger(logger)
        self._saved_level = self._logger.level
        self._changed = threading.Condition()
        self.records: list[logging.LogRecord] = []  # guarded by _changed

    def emit(self, record: logging.LogRecord) -> None:
        with self._changed:
            self.records.append(record)
            self._changed.notify_all()

    def wait(self, *parts: str, timeout: float = 10.0) -> logging.LogRecord:
        """The first record whose message holds every one of `parts`; AssertionError if none comes within `timeout` s."""

        def found() -> logging.LogRecord | None:
            return next((r for r in self.records if all(p in r.getMessage() for p in parts)), None)

        with self._changed:
            if self._changed.wait_for(found, timeout):
                return found()  # type: ignore[return-value]
            seen = [r.getMessage()[:200] for r in self.records[-5:]]
        raise AssertionError(f"timed out after {timeout:g} s waiting for a {self._logger.name} record with {parts}; last: {seen}")

    def __enter__(self) -> LogWatch:
        if self._logger.getEffectiveLevel() > self.level:
            self._logger.setLevel(self.level)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._saved_level)

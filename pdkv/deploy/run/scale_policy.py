"""The autoscaler's rules (pure, no clock of its own): how many engines to start or drain for a desired count, and
how long a scale step that failed waits before it is tried again. pdkv.deploy.run.autoscaler applies them.
"""

from __future__ import annotations


def scale_steps(desired: int, active: int, bounds: tuple[int, int]) -> int:
    """Engines to start (> 0) or drain (< 0) to bring `active` (running or starting) to `desired` within `bounds`."""
    lo, hi = bounds
    target = min(hi, max(lo, desired))
    return target - active


class RetryBackoff:
    """When a role's scale step that failed (an added engine that could not start, or died) is tried again: after
    `initial_s`, doubling with each failure in a row up to `max_s`; a step that serves resets it. Pure: the caller
    owns the clock. Not thread-safe: the autoscaler's watch thread owns it."""

    def __init__(self, initial_s: float = 10.0, max_s: float = 300.0) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError("retry backoff needs 0 < initial_s <= max_s")
        self.initial_s, self.max_s = initial_s, max_s
        self.failures = 0  # failed steps in a row
        self.not_before = 0.0

    def failed(self, now: float) -> float:
        """Record a failed step at `now`; the seconds until the next may start."""
        delay = min(self.max_s, self.initial_s * 2**self.failures)
        self.failures += 1
        self.not_before = now + delay
        return delay

    def served(self) -> None:
        """The step's engine is serving: the next failure waits `initial_s` again."""
        self.failures = 0

    def due(self, now: float) -> bool:
        return now >= self.not_before

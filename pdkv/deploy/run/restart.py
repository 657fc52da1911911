"""When a part that died is started again: now, after a backoff, or never (pure, no clock of its own).

`RestartPolicy.exited(now, code)` is told each time the part exits on its
own and answers with a `RestartDecision`:

- mode "no": no restart;
- every part is a server, so an exit nobody asked for is a failure whatever its code: vLLM's API server
  exits 0 after its engine core died (seen on an H200: a CUDA error in the engine, then a clean exit);
- more than `burst` exits within the last `window_s` seconds: give up, the part stays down;
- otherwise restart after `initial_s`, doubling with every exit since the
  part last ran `reset_after_s` without dying, up to `max_s`.

The supervisor owns the clock and the processes; this module only decides,
so every rule is tested without sleeping.
"""

from __future__ import annotations

import signal
from collections import deque
from enum import StrEnum

import msgspec

from pdkv.deploy.plan import RestartMode

RESTART_MODES: tuple[str, ...] = ("on-failure", "no")


class Verdict(StrEnum):
    RESTART = "restart"
    GIVE_UP = "give-up"  # the restart bound was reached
    NO_RESTART = "no-restart"  # the policy says "no"


class RestartDecision(msgspec.Struct, frozen=True):
    """What to do about one exit: `verdict`, after `delay_s` seconds when restarting, and why in words."""

    verdict: Verdict
    delay_s: float = 0.0
    why: str = ""


def describe_exit(code: int | None) -> str:
    """'exited with code 1', 'killed by SIGKILL' (Popen's negative return codes are signals)."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class RestartPolicy:
    """Restart decisions for one part, from the times it exited (time.monotonic() values).

    Not thread-safe: the supervisor's watch loop owns it.
    """

    def __init__(
        self,
        mode: RestartMode = "on-failure",
        *,
        initial_s: float = 1.0,
        max_s: float = 30.0,
        burst: int = 5,
        window_s: float = 60.0,
        reset_after_s: float = 300.0,
    ) -> None:
        if mode not in RESTART_MODES:
            raise ValueError(f"restart mode {mode!r} is not one of {', '.join(RESTART_MODES)}")
        if initial_s < 0 or max_s < initial_s or burst < 0 or window_s <= 0 or reset_after_s <= 0:
            raise ValueError("restart policy needs 0 <= initial_s <= max_s, burst >= 0, window_s > 0, reset_after_s > 0")
        self.mode = mode
        self.initial_s, self.max_s = initial_s, max_s
        self.burst, self.window_s, self.reset_after_s = burst, window_s, reset_after_s
        self._exits: deque[float] = deque()  # exit times within the last window_s
        self._streak = 0  # exits since the part last ran reset_after_s without dying
        self._restarted_at: float | None = None  # when the last granted restart was due
        self.restarts = 0  # restarts granted so far

    def exited(self, now: float, code: int | None) -> RestartDecision:
        """Record that the part exited on its own at `now` with `code` (negative: a signal) and decide."""
        return self.failed(now, describe_exit(code))

    def failed(self, now: float, how: str) -> RestartDecision:
        """Record a failure at `now` described by `how` (an exit, or a start that never became healthy) and decide."""
        if self.mode == "no":
            return RestartDecision(Verdict.NO_RESTART, why=f"{how}; restart = \"no\"")
        if self._restarted_at is not None and now - self._restarted_at >= self.reset_after_s:
            self._streak = 0
        self._exits.append(now)
        while self._exits and now - self._exits[0] > self.window_s:
            self._exits.popleft()
        if len(self._exits) > self.burst:
            return RestartDecision(
                Verdict.GIVE_UP,
                why=f"{how}; {len(self._exits)} exits within {self.window_s:g} s is past the bound of {self.burst} restarts, "
                "so it stays down",
            )
        delay = min(self.max_s, self.initial_s * 2**self._streak)
        self._streak += 1
        self._restarted_at = now + delay
        self.restarts += 1
        return RestartDecision(Verdict.RESTART, delay_s=delay, why=f"{how}; restart {self.restarts} in {delay:g} s")

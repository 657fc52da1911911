"""The proxy's choice (pure): which prefill engine and which decode server one request goes to.

Nothing here does I/O. `pdkv.proxy.backends` feeds it which backends are up
and how busy they are, and gets back the index of the one to use; a
`Pairing` names the pair a request is sent to.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pdkv.proxy.config import Policy


class Chooser:
    """Picks one of the candidates by policy. Round-robin keeps a cursor; least-outstanding
    takes the fewest in flight, ties broken round-robin so equal backends share load."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._cursor = 0

    def choose(self, outstanding: Sequence[int]) -> int:
        """The index of the chosen candidate; `outstanding[i]` is candidate i's in-flight count."""
        n = len(outstanding)
        if n == 0:
            raise IndexError("no candidates")
        start = self._cursor % n
        self._cursor = start + 1
        if self.policy is Policy.ROUND_ROBIN:
            return start
        best = start
        for k in range(1, n):
            i = (start + k) % n
            if outstanding[i] < outstanding[best]:
                best = i
        return best


class PrefillTarget(msgspec.Struct, frozen=True):
    """One routable prefill engine: a P server and one of its DP ranks, with that rank's engine id."""

    url: str
    bootstrap_url: str
    dp_rank: int
    dp_size: int
    engine_id: str


class Pairing(msgspec.Struct, frozen=True):
    prefill: PrefillTarget
    decode: str

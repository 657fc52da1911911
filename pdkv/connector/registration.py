"""An engine's standing registrations with the bootstrap server: done once at start, then again every
interval on a thread of their own, so a bootstrap server that restarted empty lists the engine again
within that bound.

P's side channels (`/register`): required, the engine fails to start without it. An engine's member
record (`/pdkv/members`, how the proxy finds it): best effort at start, renewed within its lease, and
dropped with `/pdkv/members/leave` when the engine stops. An identical registration is a no-op for the
registry; a refused or failed one is logged at most once a minute and tried again at the next interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pdkv.errors import StartError

log = logging.getLogger("pdkv.connector")

COMPLAIN_EVERY_S = 60.0

Action = Callable[[Any], None]  # called with a BootstrapClient


class StandingRegistration:
    """Runs `action` against the bootstrap server at `url` now, then every `interval_s`.

    `required`: a failure at start raises StartError; otherwise it is logged and retried. `on_close`
    runs once, bounded, when the registration is closed (a member's leave).
    """

    def __init__(self, url: str, action: Action, what: str, interval_s: float, *, required: bool = True,
                 on_close: Action | None = None) -> None:
        from pdkv.auth import token_from_env

        self.url, self.what, self.interval_s = url, what, interval_s
        self._action, self._on_close = action, on_close
        self._token = token_from_env()
        self._stop = threading.Event()
        self._complained = 0.0  # when a failure was last logged
        try:
            # Other TP ranks may come up before TP0's in-worker server: retry for a few seconds.
            self._run(self._action, retries=8 if required else 0)
        except Exception as exc:
            if required:
                raise StartError(f"could not register {what} with the bootstrap server at {url}: {exc}") from exc
            self._complain(exc)
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._renew, name="pdkv-register", daemon=True)
            self._thread.start()

    def _run(self, action: Action, retries: int) -> None:
        from pdkv.bootstrap import BootstrapClient

        # A bootstrap server started with --token wants it on writes: it comes from the same variable.
        with BootstrapClient(self.url, timeout=2.0, retries=retries, token=self._token) as bs:
            action(bs)

    def _complain(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._complained >= COMPLAIN_EVERY_S or not self._complained:
            self._complained = now
            log.warning("pdkv: could not register %s at %s: %s", self.what, self.url, exc)

    def _renew(self) -> None:
        from pdkv.bootstrap import BootstrapClient

        # One client for every renewal: its connection is kept between them (a broken one fails one renewal, and the
        # next connects anew).
        with BootstrapClient(self.url, timeout=2.0, retries=0, token=self._token) as bs:
            while not self._stop.wait(self.interval_s):
                try:
                    self._action(bs)
                except Exception as exc:  # noqa: BLE001 - the next interval tries again
                    self._complain(exc)

    def close(self, timeout: float = 3.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._on_close is not None:
            try:
                self._run(self._on_close, retries=0)
            except Exception as exc:  # noqa: BLE001 - the lease runs out anyway
                log.info("pdkv: could not deregister %s at %s: %s", self.what, self.url, exc)

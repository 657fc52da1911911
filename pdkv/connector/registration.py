"""P's standing registration with the bootstrap server: registered once at start (or the engine fails),
then again every interval on a thread of its own, so a bootstrap server that restarted empty lists P
again within that bound. An identical registration is a no-op for the registry; a refused or failed
one is logged at most once a minute and tried again at the next interval."""

from __future__ import annotations

import logging
import threading
import time

from pdkv.errors import StartError
from pdkv.protocol import RegisterRequest

log = logging.getLogger("pdkv.connector")

COMPLAIN_EVERY_S = 60.0


class StandingRegistration:
    """Registers `req` at the bootstrap server `url` now (StartError if it cannot), then every `interval_s`."""

    def __init__(self, url: str, req: RegisterRequest, interval_s: float) -> None:
        from pdkv.auth import token_from_env

        self.url, self.req, self.interval_s = url, req, interval_s
        self._token = token_from_env()
        self._stop = threading.Event()
        self._complained = 0.0  # the renewal thread's: when it last logged a failure
        try:
            # Other TP ranks may come up before TP0's in-worker server: retry for a few seconds.
            self._register(retries=8)
        except Exception as exc:
            raise StartError(f"could not register with the bootstrap server at {url}: {exc}") from exc
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._renew, name="pdkv-register", daemon=True)
            self._thread.start()

    def _register(self, retries: int) -> None:
        from pdkv.bootstrap.client import BootstrapClient

        # A bootstrap server started with --token wants it on /register: it comes from the same variable.
        with BootstrapClient(self.url, timeout=2.0, retries=retries, token=self._token) as bs:
            bs.register(self.req)

    def _renew(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._register(retries=0)
            except Exception as exc:  # noqa: BLE001 - the next interval tries again
                now = time.monotonic()
                if now - self._complained >= COMPLAIN_EVERY_S:
                    self._complained = now
                    log.warning("pdkv: could not renew %s's registration at %s: %s", self.req.engine_id, self.url, exc)

    def close(self, timeout: float = 3.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

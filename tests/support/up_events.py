"""The JSON events of a running `pdkv up --json`, each wait for one bounded."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time


class UpEvents:
    """Reads `proc`'s stdout on a thread; `wait(name, timeout)` returns the next event of that name (those before it are
    kept in `seen`), or raises AssertionError when `timeout` s pass or `pdkv up` ends first (with its stderr, if piped)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[dict] = []
        self._lines: queue.Queue[dict | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="pdkv-up-events", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(json.loads(line))
        self._lines.put(None)

    def wait(self, name: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {name!r} event from pdkv up within {timeout:g} s; seen {self.seen[-5:]}") from None
            if event is None:
                self._lines.put(None)  # the end stays the end for the next wait
                err = self.proc.stderr.read() if self.proc.stderr is not None else ""
                raise AssertionError(f"pdkv up ended before its {name!r} event: {err[-3000:]}")
            self.seen.append(event)
            if event.get("event") == name:
                return event

    def close(self, timeout: float = 10.0) -> None:
        """Once `pdkv up` has ended: wait for the reader to reach the end (bounded), then close the pipes."""
        self._reader.join(timeout)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

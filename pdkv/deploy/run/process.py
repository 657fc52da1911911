"""A supervised child process: its own process group, a log file, a health URL, a bounded stop.

`ManagedProcess(launch, log)` starts `launch.argv` (a `pdkv.deploy.plan.launch.Launch`)
in its own process group, logs it to a file (and optionally line by line to
a callback), binds it to the launch's cores, waits for its HTTP health
endpoint with a bound, and stops the whole group (SIGTERM to the process,
bounded grace, SIGTERM to the rest of the group, SIGKILL). `start()` may be
called again after the process has ended: the same launch, ports, cores and
environment (the supervisor's restart). While this process has a lifeline open
(pdkv.deploy.run.lifeline: `pdkv up`'s), each start is reported to it, and each
stop: its watchdog stops whatever is left if this process dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pdkv.deploy.run import lifeline
from pdkv.errors import StartError

if TYPE_CHECKING:
    from pdkv.deploy.plan import Launch


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _wait_until(done: Callable[[], bool], deadline: float) -> bool:
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ManagedProcess:
    """A supervised child: its own process group, a log file, a health URL.

    Use as a context manager (`with ManagedProcess(launch, log) as p: p.wait_healthy()`)
    so the whole group is stopped on every exit path. `on_line`, when given,
    receives each output line (for a prefixed live view) besides the log file.
    """

    def __init__(
        self,
        launch: Launch,
        log_path: str | Path,
        *,
        on_line: Callable[[str], None] | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.launch = launch
        self.name = launch.name
        self.log_path = Path(log_path)
        self.on_line = on_line
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self._lifeline: lifeline.Lifeline | None = None  # the one this start was reported to

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def url(self) -> str:
        return self.launch.url

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        line = lifeline.current()
        env = {**self.base_env, **self.launch.env, **(line.env if line is not None else {})}
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.launch.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.on_line else log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() reaches every child
            )
        except OSError as exc:
            log.close()
            raise StartError(f"{self.name}: cannot run {self.launch.argv[0]}: {exc.strerror or exc}") from None
        if line is not None:
            line.adopt(self.name, self.proc.pid, self.launch.argv, self.launch.url)
            self._lifeline = line
        if self.launch.cpus:
            # Before vLLM forks its engine core and workers (seconds of imports away): they inherit it.
            try:
                os.sched_setaffinity(self.proc.pid, self.launch.cpus)
            except OSError as exc:
                logging.getLogger("pdkv.deploy").warning("%s: could not bind to cores %s: %s", self.name, self.launch.cpus, exc)
        self.started_at = time.monotonic()
        if self.on_line:
            self._pump = threading.Thread(target=self._tee, args=(log,), name=f"pdkv-log-{self.name}", daemon=True)
            self._pump.start()
        else:
            log.close()
        return self

    def _tee(self, log) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with log, self.proc.stdout as out:
            for raw in out:
                log.write(raw)
                log.flush()
                if self.on_line is not None:
                    with contextlib.suppress(Exception):  # a display error must not block the child's pipe
                        self.on_line(raw.decode(errors="replace").rstrip("\n"))

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def check_health(self, timeout: float = 2.0) -> bool:
        import httpx

        try:
            r = httpx.get(self.launch.url + self.launch.health_path, timeout=timeout)
        except httpx.HTTPError:
            return False
        return r.status_code < 500

    def probe(self, deadline: float) -> bool:
        """One health probe: True when healthy. Raises StartError (with the log tail)
        when the process has exited or `deadline` (a time.monotonic() value) has passed."""
        assert self.proc is not None, "start() first"
        code = self.proc.poll()
        if code is not None:
            raise StartError(
                f"{self.name} exited with code {code} before it was healthy; log {self.log_path}:\n{self.log_tail()}",
                hint=f"read {self.log_path}",
            )
        if self.check_health(timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
            self.ready_at = time.monotonic()
            return True
        if time.monotonic() >= deadline:
            waited = time.monotonic() - (self.started_at or time.monotonic())
            raise StartError(
                f"{self.name} was not healthy at {self.launch.url}{self.launch.health_path} after {waited:.0f} s; "
                f"log {self.log_path}:\n{self.log_tail()}",
                hint="raise the start-up timeout or read the log",
            )
        return False

    def wait_healthy(self, timeout: float, *, interval: float = 0.5) -> float:
        """Wait until the health URL answers; return seconds since start.

        Raises StartError (with the log tail) when the process exits first or
        `timeout` passes.
        """
        deadline = time.monotonic() + timeout
        while not self.probe(deadline):
            time.sleep(interval)
        return (self.ready_at or 0.0) - (self.started_at or 0.0)

    def stop(self, grace: float = 10.0) -> int | None:
        """Stop the process and its group; return the exit code.

        SIGTERM goes to the process first, which gets `grace` s to end what it
        started; then the rest of the group gets SIGTERM and, after up to 2 s
        more, SIGKILL. vLLM's API server stops its own engine core: signalling
        the whole group at once let the engine core die first, and the API
        server then logged an EngineDeadError traceback on a clean stop.
        """
        if self.proc is None:
            return None
        proc, pgid = self.proc, self.proc.pid  # start_new_session: the group id is the child's pid
        deadline = time.monotonic() + grace
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            _wait_until(lambda: proc.poll() is not None, deadline)
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            last_chance = max(deadline, time.monotonic() + min(2.0, grace))
            if not _wait_until(lambda: proc.poll() is not None and not _group_alive(pgid), last_chance):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if self._lifeline is not None:
            self._lifeline.release(pgid)
            self._lifeline = None
        if self._pump is not None:
            self._pump.join(timeout=2)
        return proc.returncode

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""`pdkv up`'s side of its watchdog: every part it starts dies with it, however it ends.

`Lifeline(log_dir, ...)` starts the watchdog (pdkv.deploy.run.watchdog, in a session of its own) with the read end
of a pipe whose write end only this process holds, and writes the deployment's record (pdkv.deploy.run.leftovers)
into `log_dir`. While it is open it is this process's lifeline (`current()`): ManagedProcess.start puts its
marker into each part's environment and reports the part's process group (`adopt`), ManagedProcess.stop
reports it stopped (`release`), wherever the part is started from (the supervisor's start, its restarts, the
autoscaler's engines). One per process: the watchdog watches this process's death, not a thread's, which is
why this is not PR_SET_PDEATHSIG (it fires when the thread that started the child ends).

`close()`, after a clean stop, removes the record and closes the pipe: the watchdog finds nothing left and
exits at once. A process that dies with parts running closes the pipe by dying: the watchdog stops them
(SIGTERM, SIGKILL after `grace` s) and removes the record.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

from pdkv.deploy.run import watchdog
from pdkv.deploy.run.leftovers import PartRecord, UpRecord, record_path, write_record

log = logging.getLogger("pdkv.deploy")

WATCHDOG_GRACE_S = 10.0  # a part's time to stop on SIGTERM once `pdkv up` is gone, as the supervisor's own stop gives it
WATCHDOG_BOUND_S = WATCHDOG_GRACE_S + watchdog.KILL_WAIT_S  # from `pdkv up`'s death to every part gone

_lock = threading.Lock()
_current: Lifeline | None = None  # guarded by _lock: the open lifeline of this process


def current() -> Lifeline | None:
    """This process's open lifeline, if any."""
    with _lock:
        return _current


class Lifeline:
    """The watchdog's pipe and the deployment's record; `with Lifeline(...) as line:` (ManagedProcess reports to it).

    `parts` are the parts about to start (recorded before they are, so a second `pdkv up` sees what this one holds);
    `ports_of(name)` gives the ports of a part that was not among them (an engine the autoscaler adds). `command` is
    this `pdkv up`'s command line, shown by the next one.
    """

    def __init__(self, log_dir: str | Path, *, command: Sequence[str], parts: Sequence[PartRecord] = (),
                 ports_of: Callable[[str], list[tuple[str, int]]] = lambda _name: [], grace: float = WATCHDOG_GRACE_S) -> None:
        import psutil

        self.log_dir = Path(log_dir)
        self.path = record_path(log_dir)
        self.grace = grace
        self.marker = secrets.token_hex(8)
        self._ports_of = ports_of
        self._pipe: int | None = None  # guarded by _write: the write end
        self._write = threading.Lock()  # guards the pipe and the record
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._warned = False  # guarded by _write: the watchdog's absence was logged
        self.record = UpRecord(pid=os.getpid(), started=psutil.Process().create_time(), command=list(command), cwd=os.getcwd(),
                               log_dir=str(self.log_dir.absolute()), marker=self.marker, parts=[*parts])

    @property
    def env(self) -> dict[str, str]:
        """What each part's environment carries, so the watchdog finds its processes even outside its group."""
        return {watchdog.MARKER_ENV: self.marker}

    def open(self) -> Lifeline:
        global _current
        with _lock:
            if _current is not None:
                raise RuntimeError("this process has a lifeline open already")
            _current = self
        try:
            self._start_watchdog()
        except BaseException:
            with _lock:
                _current = None
            raise
        return self

    def _start_watchdog(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        read, write = os.pipe()  # both ends close on exec: only the watchdog gets the read end (as its stdin)
        try:
            # Run by path (nothing of pdkv is imported there); -P: its own folder, pdkv/deploy, is not put on sys.path.
            self._watchdog = subprocess.Popen(
                [sys.executable, "-P", watchdog.__file__, "--marker", self.marker, "--grace", str(self.grace),
                 "--record", str(self.path.absolute()), "--log", str((self.log_dir / "watchdog.log").absolute())],
                stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        with self._write:
            self._pipe = write
            self.record.watchdog = self._watchdog.pid
            write_record(self.path, self.record)

    def _send(self, line: str) -> None:
        if self._pipe is None:
            return
        try:
            os.write(self._pipe, line.encode() + b"\n")  # shorter than PIPE_BUF: written whole
        except BrokenPipeError:  # the watchdog is gone (killed by hand): the record still says what runs
            if not self._warned:
                self._warned = True
                log.warning("the watchdog (pid %s) is gone: the parts would outlive this process if it were killed; "
                            "`pdkv down --log-dir %s` stops them then", self.record.watchdog, self.log_dir)

    def adopt(self, name: str, pid: int, argv: Sequence[str], url: str) -> None:
        """A part started: `pid` leads its process group."""
        import psutil

        try:
            started: float | None = psutil.Process(pid).create_time()
        except psutil.Error:
            started = None
        with self._write:
            if self._pipe is None:
                raise RuntimeError("the lifeline is closed")
            part = next((p for p in self.record.parts if p.name == name), None)
            if part is None:
                part = PartRecord(name=name, url=url, ports=self._ports_of(name), command=list(argv))
                self.record.parts.append(part)
            if part.pgid is not None:
                self._send(f"-{part.pgid}")
            part.pid, part.pgid, part.started, part.command = pid, pid, started, list(argv)
            self._send(f"+{pid} {name}")
            write_record(self.path, self.record)

    def release(self, pgid: int) -> None:
        """The process group `pgid` was stopped."""
        with self._write:
            if self._pipe is None:  # closed: the watchdog has taken over, and the record is its
                return
            self._send(f"-{pgid}")
            for part in self.record.parts:
                if part.pgid == pgid:
                    part.pid = part.pgid = part.started = None
            write_record(self.path, self.record)

    def close(self, timeout: float | None = None) -> int | None:
        """Close the pipe: the watchdog stops what is still adopted (nothing after a clean stop) and exits. Waits for it,
        up to `timeout` s (default: its own bound and 5 s); its exit code (None if it is still at work)."""
        global _current
        with _lock:
            if _current is self:
                _current = None
        with self._write:
            if self._pipe is None:
                return None
            if not any(p.pgid is not None for p in self.record.parts):
                try:
                    self.path.unlink()
                except OSError:
                    pass
            os.close(self._pipe)
            self._pipe = None
        assert self._watchdog is not None
        try:
            return self._watchdog.wait(WATCHDOG_BOUND_S + 5.0 if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Stopping a process for a test, and knowing it is stopped.

`kill(pid, SIGSTOP)` returns before the process has stopped. The kernel wakes one
of its threads to take the signal; only when that thread runs does it stop the
others. Until then the rest keep running: on a loaded 2-core host a Mooncake
engine's io thread was seen to read a write and send its acknowledgment some
milliseconds after `kill` returned, so a test that "stopped" its peer saw the
next write succeed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from support.waiting import wait_for


def thread_states(pid: int) -> list[str]:
    """The state letter (R, S, T, ...) of each thread of `pid`, from /proc/<pid>/task/*/stat."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread ended meanwhile
            continue
        states.append(text[text.rindex(")") + 2])  # the name in parentheses may hold spaces or ")"
    return states


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every one of its threads is stopped (state T); AssertionError after `timeout` s."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: set(thread_states(pid)) == {"T"}, timeout, f"every thread of process {pid} to stop", interval=0.001)


def resume_process(pid: int) -> None:
    """SIGCONT `pid`."""
    os.kill(pid, signal.SIGCONT)

"""The watchdog `pdkv up` starts before its first part: when `pdkv up` ends without stopping its parts (SIGKILL,
the OOM killer, a crash), the watchdog stops them, within `grace` + KILL_WAIT_S seconds.

It is a process of its own, in a session of its own (no signal meant for a terminal's jobs reaches it), run
by path (pdkv.deploy.run.lifeline starts it): it imports the standard library and psutil only, never pdkv, so it
starts in a fraction of a second and is the same code whatever pdkv the parts import.

Its standard input is the read end of a pipe whose write end only `pdkv up` holds. `pdkv up` writes
`+PGID NAME` when a part's process group starts and `-PGID` once it has stopped it. End of file means
`pdkv up` is gone, however it ended: the kernel closes the write end of a dead process. Then every group
still listed, and the group of every live process whose environment carries the deployment's marker
(`MARKER_ENV`: a process that left its part's group, or a part started in the instant before its line was
written), is stopped as ManagedProcess.stop stops one: SIGTERM to the group's leader, which stops what it
started (a vLLM API server its engine core and workers); SIGTERM to the rest of a group whose leader is gone;
SIGKILL to every group still alive after `grace` s. After a clean stop nothing is listed and nothing carries
the marker: it exits at once. `stop_groups` and `deployment_groups` are `pdkv down`'s way to stop the same
groups (pdkv.deploy.run.leftovers).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

MARKER_ENV = "PDKV_UP_MARKER"  # in every part's environment: which `pdkv up` started it
KILL_WAIT_S = 2.0  # after SIGKILL, for the kernel to reap what it killed
POLL_S = 0.1


def _scan() -> list[tuple[int, int, psutil.Process]]:
    """(pid, process group, process) of every live process of this host; zombies count as gone (their sockets are
    closed already, and a parent that never reaps them must not make a stop wait)."""
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            out.append((proc.pid, os.getpgid(proc.pid), proc))
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return out


def _carries(proc: psutil.Process, marker: str) -> bool | None:
    """Whether `proc`'s environment holds MARKER_ENV=marker; None when it cannot be read (another user's)."""
    try:
        return proc.environ().get(MARKER_ENV) == marker
    except psutil.AccessDenied:
        return None
    except psutil.Error:
        return False


def deployment_groups(marker: str, pgids: Iterable[int] = ()) -> set[int]:
    """The live process groups of the deployment whose parts carry `marker`: the group of each live process that
    carries it, and each of `pgids` with a live member whose environment cannot be read. A group of `pgids` whose
    members all lack the marker is another program's that got the number after the part's group was gone."""
    listed = set(pgids)
    found: set[int] = set()
    for _pid, pgid, proc in _scan():
        if pgid in found:
            continue
        carries = _carries(proc, marker)
        if carries or (carries is None and pgid in listed):
            found.add(pgid)
    return found


def live_groups(pgids: Iterable[int]) -> set[int]:
    """Those of `pgids` with a live (not zombie) member."""
    wanted = set(pgids)
    return {pgid for _pid, pgid, _proc in _scan() if pgid in wanted}


def _signal(pgid: int, sig: signal.Signals, *, leader_only: bool) -> None:
    try:
        if leader_only:
            os.kill(pgid, sig)
        else:
            os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(pgids: Iterable[int], grace: float, *, say: Callable[[str], None] = lambda _line: None) -> set[int]:
    """Stop every process of `pgids` (process groups, each led by a part): SIGTERM to each leader (the rest of its
    group when the leader is gone), SIGKILL to what is alive after `grace` s. Returns the groups still alive
    KILL_WAIT_S after that (a process of another user: nothing this one may signal). Bounded: grace + KILL_WAIT_S."""
    left = live_groups(pgids)
    leaders = {pid for pid, pgid, _proc in _scan() if pid == pgid and pgid in left}
    for pgid in left:
        _signal(pgid, signal.SIGTERM, leader_only=pgid in leaders)
    termed = {pgid for pgid in left if pgid not in leaders}
    deadline = time.monotonic() + grace
    while left and time.monotonic() < deadline:
        time.sleep(POLL_S)
        table = _scan()
        left = {pgid for _pid, pgid, _proc in table if pgid in left}
        led = {pid for pid, _pgid, _proc in table if pid in left}
        for pgid in left - led - termed:  # the leader has stopped; what it left behind gets its SIGTERM now
            _signal(pgid, signal.SIGTERM, leader_only=False)
            termed.add(pgid)
    if left:
        say(f"still alive after {grace:g} s: process group(s) {', '.join(map(str, sorted(left)))}; SIGKILL")
        for pgid in left:
            _signal(pgid, signal.SIGKILL, leader_only=False)
        deadline = time.monotonic() + KILL_WAIT_S
        while left and time.monotonic() < deadline:
            time.sleep(POLL_S)
            left = live_groups(left)
    return left


def watch(lines: Iterable[bytes], marker: str, grace: float, say: Callable[[str], None]) -> set[int]:
    """Follow `pdkv up`'s lines until end of file, then stop what is left of the deployment; the groups still
    alive after that (empty when all stopped)."""
    names: dict[int, str] = {}  # listed group -> its part's name; owned by this loop
    for raw in lines:
        sign, _, rest = raw.decode(errors="replace").strip().partition(" ")
        if len(sign) < 2 or sign[0] not in "+-" or not sign[1:].isdigit():
            continue
        pgid = int(sign[1:])
        if sign[0] == "+":
            names[pgid] = rest or str(pgid)
        else:
            names.pop(pgid, None)
    targets = deployment_groups(marker, names)
    if not targets:
        return set()
    listed = ", ".join(f"{names.get(g, 'a process carrying the marker')} (group {g})" for g in sorted(targets))
    say(f"pdkv up ended and left its parts running; stopping {listed}")
    t0 = time.monotonic()
    left = stop_groups(targets, grace, say=say)
    if left:
        say(f"could not stop process group(s) {', '.join(map(str, sorted(left)))}")
    else:
        say(f"every part stopped after {time.monotonic() - t0:.1f} s")
    return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdkv-watchdog", description="Stops a deployment's parts when `pdkv up` ends.")
    parser.add_argument("--marker", required=True)
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--record", type=Path, help="the deployment's record, removed once nothing of it is left")
    parser.add_argument("--log", type=Path, required=True, help="written only when there is something to stop")
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP):  # only the pipe's end tells it to act
        signal.signal(sig, signal.SIG_IGN)

    def say(line: str) -> None:
        try:
            with args.log.open("a") as log:
                log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} watchdog (pid {os.getpid()}): {line}\n")
        except OSError:
            pass

    try:
        left = watch(sys.stdin.buffer, args.marker, args.grace, say)
    except Exception:  # noqa: BLE001 - nobody else would see it: the log is the one place it can go
        say("failed:\n" + traceback.format_exc())
        return 1
    if not left and args.record is not None:
        try:
            args.record.unlink()
        except OSError:
            pass
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())

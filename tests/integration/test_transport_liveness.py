"""Peer liveness of the host-local transports (pdkv.transport.host): real child processes, killed.

What CUDA IPC's writer checks before and after every copy, on CPU: a peer's
exit is seen at once through its pidfd, a pid that names another process is
refused, and the peers that live on are still served.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdkv.errors import TransferError
from pdkv.transport.host import PeerProcess, WatchedPeers, ipc_session, process_start_time

SLEEPER = "import time; time.sleep(120)"
# The main thread exits while another thread lives on: the process has begun to exit (its leader is a zombie
# with PF_EXITING set) and its pidfd stays silent until the last thread ends, as while a killed process that
# held a CUDA context is torn down.
HALF_EXITED = (
    "import ctypes, threading, time; threading.Thread(target=time.sleep, args=(120,)).start(); "
    "print('up', flush=True); time.sleep(0.2); ctypes.CDLL(None).pthread_exit(None)"
)


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def start(code: str = SLEEPER) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def _dead_within(process: PeerProcess, bound_s: float = 2.0) -> float:
    """Seconds until `process.alive()` turned False; fails past the bound."""
    t0 = time.monotonic()
    while process.alive():
        assert time.monotonic() - t0 < bound_s, f"exit of {process.pid} not seen within {bound_s} s"
        time.sleep(0.001)
    return time.monotonic() - t0


def test_a_killed_child_reads_as_dead_before_it_is_reaped(spawn):
    child = spawn()
    process = PeerProcess(child.pid, process_start_time(child.pid))
    assert process.alive()
    os.kill(child.pid, signal.SIGKILL)
    _dead_within(process)
    assert child.poll() is None or child.returncode == -signal.SIGKILL  # seen as a zombie or once reaped
    child.wait(10)
    assert not process.alive()
    process.close()


def test_a_pid_with_another_start_time_or_no_process_is_refused(spawn):
    child = spawn()
    with pytest.raises(TransferError, match="pid was reused"):
        PeerProcess(child.pid, process_start_time(child.pid) + 1)
    child.kill()
    child.wait(10)
    with pytest.raises(TransferError, match="does not exist"):
        PeerProcess(child.pid, 0)


def test_a_process_that_has_begun_to_exit_counts_as_dead_with_exiting(spawn):
    child = spawn(HALF_EXITED)
    assert child.stdout.readline() == b"up\n"
    start = process_start_time(child.pid)
    pidfd_only, exiting = PeerProcess(child.pid, start), PeerProcess(child.pid, start, exiting=True)
    _dead_within(exiting)
    assert pidfd_only.alive(), "the pidfd is silent while a thread of the process lives on"
    child.kill()
    child.wait(10)
    _dead_within(pidfd_only)
    for process in (pidfd_only, exiting):
        process.close()


def test_closed_peer_reads_as_dead(spawn):
    child = spawn()
    process = PeerProcess(child.pid, process_start_time(child.pid))
    process.close()
    assert not process.alive()
    process.close()  # twice is harmless


def test_without_pidfd_open_the_peer_is_watched_through_proc(spawn, monkeypatch):
    """A kernel without pidfd_open (before Linux 5.3, some sandboxes) cannot exist here: os.pidfd_open is made to fail."""

    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    child = spawn()
    start = process_start_time(child.pid)
    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    process = PeerProcess(child.pid, start)
    assert process.alive()
    os.kill(child.pid, signal.SIGKILL)
    _dead_within(process)  # a zombie counts as exited
    with pytest.raises(TransferError, match="pid was reused"):
        PeerProcess(os.getpid(), 0)


def test_watched_peers_fail_the_dead_one_and_keep_the_others(spawn):
    d1, d2 = spawn(), spawn()
    watched = WatchedPeers()
    watched.watch("d1", d1.pid)
    watched.watch("d2", d2.pid, process_start_time(d2.pid))
    closed: list[str] = []
    watched.check("d1", closed.append)
    watched.check("d2", closed.append)
    assert closed == [] and sorted(watched.names()) == ["d1", "d2"]

    os.kill(d1.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match=rf"decode process {d1.pid} \(d1\) exited; its CUDA IPC handles are closed") as exc:
        while time.monotonic() - t0 < 2:
            watched.check("d1", closed.append)
            time.sleep(0.001)
    assert exc.value.hint and "D died" in exc.value.hint
    assert closed == ["d1"] and watched.names() == ["d2"]
    with pytest.raises(TransferError, match=r"\(d1\) exited"):  # later writes say why too
        watched.check("d1", closed.append)
    watched.check("d2", closed.append)  # the other peer is served on
    assert closed == ["d1", "d1"]

    d1.wait(10)
    with pytest.raises(TransferError, match="does not exist|exited"):  # reconnecting to the dead process
        watched.watch("d1", d1.pid)
    os.kill(d2.pid, signal.SIGKILL)
    d2.wait(10)
    watched.sweep(closed.append)
    assert closed[-1] == "d2" and watched.names() == []


def test_an_ipc_session_address_names_its_process_and_a_wrong_start_time_is_refused(spawn):
    session = ipc_session(os.getpid(), 3)
    assert session.startswith("ipc://") and session.split("/")[-2:] == ["3", str(process_start_time(os.getpid()))]
    child = spawn()
    # What an IpcExport says of a process that is not the one now under its pid: a reused pid.
    with pytest.raises(TransferError, match="pid was reused"):
        WatchedPeers().watch(session, child.pid, process_start_time(child.pid) + 1)
    watched = WatchedPeers()
    watched.watch(session, child.pid, process_start_time(child.pid))
    assert watched.names() == [session]


def test_a_write_waiting_for_a_held_lock_fails_once_its_peer_dies_and_the_next_holder_closes_it(spawn):
    d1, d2 = spawn(), spawn()
    watched = WatchedPeers()
    watched.watch("d1", d1.pid)
    watched.watch("d2", d2.pid)
    closed: list[str] = []

    def close(peer: str) -> None:  # as the transport's _disconnect: close the handles, stop watching
        closed.append(peer)
        watched.forget(peer)

    lock = threading.RLock()
    release, held = threading.Event(), threading.Event()

    def hog() -> None:  # a write to another peer that holds the lock all along
        with watched.holding(lock, "d2", close):
            held.set()
            release.wait(30)

    outcome: list[object] = []

    def waiter() -> None:
        try:
            with watched.holding(lock, "d1", close):
                outcome.append("got the lock")
        except TransferError as exc:
            outcome.append((time.monotonic(), exc))

    hogger = threading.Thread(target=hog)
    hogger.start()
    assert held.wait(10)
    waiting = threading.Thread(target=waiter)
    waiting.start()
    time.sleep(0.05)
    assert outcome == []  # still waiting: d1 lives
    os.kill(d1.pid, signal.SIGKILL)
    killed = time.monotonic()
    waiting.join(5)
    assert len(outcome) == 1 and not isinstance(outcome[0], str), outcome
    at, exc = outcome[0]
    assert at - killed < 2.0 and f"decode process {d1.pid} (d1) exited" in exc.message
    assert closed == []  # the waiter never held the lock
    release.set()
    hogger.join(10)
    with watched.holding(lock, "d2", close):  # the next holder closes the dead peer's handles
        assert closed == ["d1"]
    with watched.holding(lock, "d2", close):
        assert closed == ["d1"]  # once

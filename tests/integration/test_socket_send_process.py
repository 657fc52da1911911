"""P's send process (socket_send_process) as a process: it never outlives P, whatever way P ends, and a child that
cannot write says why at once. Its data path (P's GPU memory opened through CUDA IPC, staged and written to D byte
for byte) runs on the GPU tier: tests/gpu/test_socket_gpu.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from pdkv.errors import TransferError
from pdkv.transport.sockets import send_wire
from pdkv.transport.sockets.send_process import SendProcess

CHILD = [sys.executable, "-m", "pdkv.transport.sockets.send_main"]
SETUP = send_wire.Setup(0, 2, 5.0, 0, 1 << 20, "copies", 200, None)


def _start_child() -> tuple[socket.socket, subprocess.Popen[bytes]]:
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen([*CHILD, str(theirs.fileno())], pass_fds=(theirs.fileno(),))
    finally:
        theirs.close()
    return ours, proc


def _gone(pid: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie (its parent has not reaped it yet) has ended
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        time.sleep(0.05)
    return False


def test_the_child_ends_when_p_closes_its_end_before_or_after_the_setup():
    ours, proc = _start_child()
    ours.close()
    assert proc.wait(10) == 2  # no setup ever came
    ours, proc = _start_child()
    ours.sendall(send_wire.encode(send_wire.Ready()))  # not a Setup: refused, the child ends
    assert proc.wait(10) == 2
    ours.close()


def test_the_child_ends_on_a_message_that_is_not_one():
    ours, proc = _start_child()
    with ours:
        ours.sendall(b"\x00\x00\x00\x03\xc1\xc1\xc1")
        assert proc.wait(10) == 2


def test_the_child_of_a_p_killed_with_sigkill_ends_within_seconds():
    """P's end of the socket pair closes when P dies, however it dies; the child reads the end and exits."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import socket, subprocess, sys, time
        ours, theirs = socket.socketpair()
        child = subprocess.Popen({CHILD!r} + [str(theirs.fileno())], pass_fds=(theirs.fileno(),))
        theirs.close()
        print(child.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    with holder:
        try:
            assert holder.stdout is not None
            child = int(holder.stdout.readline())
            assert not _gone(child, 0.5)  # it waits for its setup
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
            assert _gone(child, 10), "the send process outlived its P"
        finally:
            holder.kill()


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a GPU host: the child starts there (tests/gpu)")
def test_a_child_that_cannot_start_cuda_says_why_at_once_and_no_write_waits_for_it():
    sp = SendProcess(SETUP)
    try:
        t0 = time.monotonic()
        assert sp.wait(60) is False and time.monotonic() - t0 < 30  # settled by the child's word, not the bound
        assert "the send process stopped" in sp.broken and not sp.ready
        assert sp.proc.wait(10) == 1
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="the send process cannot write"):
            sp.write("socket://127.0.0.1:9/" + "00" * 16, "t", [(0x1000, 0x2000, 64)], 30.0)
        assert time.monotonic() - t0 < 1
    finally:
        sp.close()

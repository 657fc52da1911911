"""P's send process (socket_send_process): it never outlives P, whatever way P ends; a child that cannot write says
why at once; and its work (each message's ranges mapped into its own opening of P's memory, written to a real D over
real sockets, each answered) with host memory standing in for P's GPU memory, which only a GPU host can open through
CUDA IPC (there: tests/gpu/test_socket_gpu.py)."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time

import threading

import numpy as np
import pytest

from pdkv.errors import TransferError
from pdkv.transport.sockets import SocketTransport, send_wire
from pdkv.transport.sockets.send_main import Child
from pdkv.transport.sockets.send_process import SendProcess
from pdkv.wire import IpcAllocation, IpcExport, IpcRegion, Region

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


def test_the_child_ends_when_p_closes_its_end_or_its_first_message_is_no_setup():
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


@pytest.fixture
def no_core_files():
    """Children that crash here leave no core file behind (they inherit the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))


def _reading_its_socket(pid: int, timeout_s: float) -> bool:
    """Whether the child sleeps reading its socket pair (past its imports and main's start) within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with open(f"/proc/{pid}/wchan") as f:
            if "unix_stream" in f.read():
                return True
        time.sleep(0.05)
    return False


def test_a_child_that_crashes_prints_its_threads_stacks(no_core_files):
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen([*CHILD, str(theirs.fileno())], pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE, text=True)
    finally:
        theirs.close()
    with ours, proc:
        if not _reading_its_socket(proc.pid, 30):
            proc.kill()
            pytest.skip("this kernel does not say where a process sleeps (/proc/PID/wchan)")
        proc.send_signal(signal.SIGSEGV)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in err and "send_main.py" in err, err


@pytest.mark.parametrize(("sig", "said"), [
    (signal.SIGSEGV, "the send process was killed by SIGSEGV (its threads' stacks: this process's stderr)"),
    (signal.SIGKILL, "the send process was killed by SIGKILL"),  # no stacks: nothing runs on SIGKILL
])
def test_p_names_the_signal_that_killed_its_send_process_and_no_write_waits(no_core_files, sig, said):
    sp = SendProcess(SETUP)
    try:
        sp.proc.send_signal(sig)  # within its imports: it has said nothing yet
        state = sp.wait(30)
        assert state == sp.broken == said
        with pytest.raises(TransferError, match=f"killed by {sig.name}"):
            sp.write("socket://127.0.0.1:9/" + "00" * 16, "t", [(0x1000, 0x2000, 64)], 30.0)
    finally:
        sp.close()


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a GPU host: the child starts there (tests/gpu)")
def test_a_child_that_cannot_start_cuda_says_why_at_once_and_no_write_waits_for_it():
    sp = SendProcess(SETUP)
    try:
        t0 = time.monotonic()
        assert sp.wait(60) == sp.broken and time.monotonic() - t0 < 30  # settled by the child's word, not the bound
        assert "the send process stopped" in sp.broken and not sp.ready
        assert sp.proc.wait(10) == 1
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="the send process cannot write"):
            sp.write("socket://127.0.0.1:9/" + "00" * 16, "t", [(0x1000, 0x2000, 64)], 30.0)
        assert time.monotonic() - t0 < 1
    finally:
        sp.close()


def test_the_child_writes_each_message_from_its_own_opening_of_p_s_memory_and_answers_each():
    """The child reads P's ranges where its opening maps them (here another buffer, with other bytes than P's own
    addresses hold), writes them to D, and answers Done with the bytes landed; a write D did not grant, and a range
    outside the opening, are answered Failed with the reason; the end of P's socket ends it."""
    size, n = 4 << 20, 64 << 10
    p_mem = np.zeros(size, dtype=np.uint8)  # P's addresses: never read by the child
    here = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)  # the child's opening of them
    p0, h0 = p_mem.ctypes.data, here.ctypes.data
    d_mem = np.zeros(size, dtype=np.uint8)
    export = IpcExport("boot:host", os.getpid(), 0, "", [IpcAllocation(b"h" * 64, p0, size)],
                       [IpcRegion(0, p0, size // 2), IpcRegion(0, p0 + size // 2, size // 2)], 1)
    ours, theirs = socket.socketpair()
    ours.settimeout(30)
    with SocketTransport("127.0.0.1", write_timeout_s=10) as d, SocketTransport(writable=False, connections=2) as mine:
        d.register([(d_mem.ctypes.data, size)])
        d.expect("k", [(d_mem.ctypes.data, size)])
        child = Child(theirs, mine, lambda e: [(r.base, r.base + r.length, h0 + r.base - p0) for r in e.regions])
        serving = threading.Thread(target=child.serve, args=(send_wire.messages(theirs),), daemon=True)
        serving.start()
        replies = send_wire.messages(ours)
        ranges = [(p0 + k * 3 * n, d_mem.ctypes.data + (size - (k + 1) * n), n) for k in range(20)]  # scattered, reversed
        ours.sendall(send_wire.encode(send_wire.Memory(export)))
        ours.sendall(send_wire.encode(send_wire.Write(1, d.session_address, "k", ranges, 10.0)))
        assert next(replies) == send_wire.Done(1, 20 * n, 20)
        for k in range(20):
            assert np.array_equal(d_mem[size - (k + 1) * n : size - k * n], here[k * 3 * n : k * 3 * n + n]), k
        # Blocks: the child plans the descriptors from P's regions, mapped into its opening
        half = size // 2 // n
        p_regions = [Region(p0, n, half), Region(p0 + size // 2, n, half)]
        d_regions = [Region(d_mem.ctypes.data, n, half), Region(d_mem.ctypes.data + size // 2, n, half)]
        d_mem[:] = 0
        ours.sendall(send_wire.encode(send_wire.WriteBlocks(4, d.session_address, "k", [5, 6, 30], [1, 9, 2], p_regions, d_regions,
                                                            None, 10.0)))
        assert next(replies) == send_wire.Done(4, 2 * 3 * n, 6)
        for r in range(2):
            for src, dst in ((5, 1), (6, 9), (30, 2)):
                got = d_mem[r * size // 2 + dst * n : r * size // 2 + (dst + 1) * n]
                assert np.array_equal(got, here[r * size // 2 + src * n : r * size // 2 + (src + 1) * n]), (r, src)
        ours.sendall(send_wire.encode(send_wire.WriteBlocks(5, d.session_address, "k", [half], [0], p_regions, d_regions, None, 10.0)))
        past = next(replies)  # a block id past P's region: refused before a byte moves
        assert isinstance(past, send_wire.Failed) and past.ident == 5 and f"block id {half} is outside" in past.why
        # Many writes in flight at once (P's writer threads), answered each by its ident, in whatever order they end
        d_mem[:] = 0
        batch = {100 + k: [(p0 + k * n, d_mem.ctypes.data + (63 - k) * n, n)] for k in range(32)}
        ours.sendall(b"".join(send_wire.encode(send_wire.Write(i, d.session_address, "k", r, 10.0)) for i, r in batch.items()))
        assert sorted((m.ident, m.landed) for m in (next(replies) for _ in batch)) == [(i, n) for i in batch]
        assert all(np.array_equal(d_mem[(63 - k) * n : (64 - k) * n], here[k * n : (k + 1) * n]) for k in range(32))
        ours.sendall(send_wire.encode(send_wire.Write(2, d.session_address, "never-granted", ranges[:1], 10.0)))
        refused = next(replies)
        assert isinstance(refused, send_wire.Failed) and refused.ident == 2 and "refused" in refused.why
        ours.sendall(send_wire.encode(send_wire.Write(3, d.session_address, "k", [(p0 + size - 8, d_mem.ctypes.data, 16)], 10.0)))
        outside = next(replies)
        assert isinstance(outside, send_wire.Failed) and outside.ident == 3 and "outside the memory" in outside.why
        ours.close()
        serving.join(10)
        assert not serving.is_alive()
        child.pool.shutdown(wait=True)
    theirs.close()

"""ManagedProcess with real child processes (no sockets): process groups, logs, early exit."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from pdkv.errors import StartError
from pdkv.deploy.plan.launch import Launch
from pdkv.deploy.run.process import ManagedProcess
from support.waiting import wait_for

# A parent that starts a grandchild in the same process group, prints both pids, then waits.
FAMILY = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('pids', child.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _plan(code: str, name: str = "child") -> Launch:
    return Launch(name=name, argv=[sys.executable, "-c", code], env={"PDKV_TEST_VALUE": "42"}, url="http://127.0.0.1:1")


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    lines: list[str] = []
    proc = ManagedProcess(_plan(FAMILY), tmp_path / "family.log", on_line=lines.append).start()
    try:
        wait_for(lambda: any(line.startswith("pids") for line in lines))
        grandchild = int(next(line for line in lines if line.startswith("pids")).split()[1])
        assert os.getpgid(grandchild) == proc.pid  # its own group, led by the child
        assert _alive(grandchild)
    finally:
        code = proc.stop(grace=5)
    assert code is not None
    assert not _alive(proc.pid)
    wait_for(lambda: not _alive(grandchild), timeout=5)
    assert "pids" in (tmp_path / "family.log").read_text()  # tee'd to the log as well


def test_stop_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)\n"
    lines: list[str] = []
    proc = ManagedProcess(_plan(code), tmp_path / "stubborn.log", on_line=lines.append).start()
    wait_for(lambda: "ready" in lines)
    t0 = time.monotonic()
    assert proc.stop(grace=0.5) == -9
    assert time.monotonic() - t0 < 5


def test_early_exit_raises_start_error_with_the_log_tail(tmp_path: Path) -> None:
    code = (
        "import os, sys\nprint('value', os.environ['PDKV_TEST_VALUE'])\n"
        "print('engine failed: out of cheese', file=sys.stderr)\nsys.exit(7)\n"
    )
    proc = ManagedProcess(_plan(code, "engine"), tmp_path / "engine.log").start()
    proc.proc.wait(timeout=10)
    with pytest.raises(StartError) as info:
        proc.wait_healthy(timeout=5)
    assert "engine exited with code 7" in info.value.message
    assert "out of cheese" in info.value.message and "value 42" in info.value.message
    assert proc.stop() == 7


def test_context_manager_stops_on_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), ManagedProcess(_plan("import time; time.sleep(60)"), tmp_path / "x.log") as proc:
        pid = proc.pid
        raise RuntimeError("test body failed")
    assert pid is not None and not _alive(pid)


def test_missing_executable_is_a_start_error(tmp_path: Path) -> None:
    plan = Launch(name="ghost", argv=["/nonexistent/vllm"], env={}, url="http://127.0.0.1:1")
    with pytest.raises(StartError, match="cannot run"):
        ManagedProcess(plan, tmp_path / "ghost.log").start()


def test_cpu_engine_processes_are_bound_to_their_cores(tmp_path: Path) -> None:
    # The child and what it starts later (vLLM's engine core and workers) run only on the plan's cores.
    core = sorted(os.sched_getaffinity(0))[-1]
    plan = Launch(name="bound", argv=[sys.executable, "-c", FAMILY], env={}, url="http://127.0.0.1:1", cpus=[core])
    lines: list[str] = []
    proc = ManagedProcess(plan, tmp_path / "bound.log", on_line=lines.append).start()
    try:
        wait_for(lambda: any(line.startswith("pids") for line in lines))
        grandchild = int(next(line for line in lines if line.startswith("pids")).split()[1])
        assert os.sched_getaffinity(proc.pid) == {core}
        assert os.sched_getaffinity(grandchild) == {core}
    finally:
        proc.stop(grace=5)


# A parent that stops its own child when told to stop (as vLLM's API server stops its engine core),
# and a child that says so when a SIGTERM reaches it from anyone else.
STOPS_ITS_CHILD = (
    "import signal, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import signal, sys, time\\n"
    "signal.signal(signal.SIGTERM, lambda *a: (print(\"child: SIGTERM before its parent stopped it\", flush=True), sys.exit(1)))\\n"
    "signal.signal(signal.SIGUSR1, lambda *a: (print(\"child: stopped by its parent\", flush=True), sys.exit(0)))\\n"
    "print(\"child ready\", flush=True)\\n"
    "time.sleep(60)'])\n"
    "def stop(*a):\n"
    "    time.sleep(0.3)\n"  # an API server takes a moment to begin its shutdown
    "    child.send_signal(signal.SIGUSR1); child.wait(5); print('parent: child stopped', flush=True); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "time.sleep(60)\n"
)


def test_stop_signals_the_process_before_its_group(tmp_path: Path) -> None:
    lines: list[str] = []
    proc = ManagedProcess(_plan(STOPS_ITS_CHILD), tmp_path / "parent.log", on_line=lines.append).start()
    wait_for(lambda: "child ready" in lines)
    assert proc.stop(grace=5) == 0
    log = (tmp_path / "parent.log").read_text()
    assert "child: stopped by its parent" in log and "parent: child stopped" in log
    assert "before its parent stopped it" not in log


def test_stop_reaches_what_the_process_left_behind(tmp_path: Path) -> None:
    # The parent exits at once on SIGTERM and leaves its child running: the group's SIGTERM ends the child.
    code = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "print('pids', child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    lines: list[str] = []
    proc = ManagedProcess(_plan(code), tmp_path / "orphan.log", on_line=lines.append).start()
    wait_for(lambda: any(line.startswith("pids") for line in lines))
    child = int(next(line for line in lines if line.startswith("pids")).split()[1])
    t0 = time.monotonic()
    assert proc.stop(grace=5) == 0
    assert time.monotonic() - t0 < 5
    wait_for(lambda: not _alive(child), timeout=5)

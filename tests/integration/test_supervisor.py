"""The deployment Supervisor over real `pdkv bootstrap` processes on 127.0.0.1: stages, health, death, stop."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import psutil
import pytest

from pdkv.deploy import Supervisor
from pdkv.errors import StartError
from pdkv.launch import LaunchPlan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bootstrap_plan(name: str) -> LaunchPlan:
    port = free_port()
    argv = [sys.executable, "-m", "pdkv", "bootstrap", "--host", "127.0.0.1", "--port", str(port)]
    return LaunchPlan(name=name, argv=argv, env={}, url=f"http://127.0.0.1:{port}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stages_start_in_order_and_stop_leaves_nothing(tmp_path: Path) -> None:
    plans = [bootstrap_plan("a"), bootstrap_plan("b"), bootstrap_plan("c")]
    changes: list[dict[str, str]] = []
    sup = Supervisor(plans, tmp_path, stages=[0, 1, 1])
    sup.on_change = lambda: changes.append(dict(sup.states))
    with sup:
        sup.start_all(timeout=30)
        assert sup.states == {"a": "ready", "b": "ready", "c": "ready"}
        # b and c started only after a was ready, and together.
        first_b = next(i for i, s in enumerate(changes) if s["b"] == "starting")
        assert changes[first_b]["a"] == "ready" and changes[first_b + 1]["c"] == "starting"
        pids = sup.pids()
        assert len(pids) == 3 and all(_alive(p) for p in pids)
    assert sup.states == {"a": "stopped", "b": "stopped", "c": "stopped"}
    assert not [p for p in pids if _alive(p)]
    assert all((tmp_path / f"{n}.log").exists() for n in "abc")


def test_a_part_that_dies_is_reported(tmp_path: Path) -> None:
    with Supervisor([bootstrap_plan("a"), bootstrap_plan("b")], tmp_path) as sup:
        sup.start_all(timeout=30)
        victim = sup.procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        assert sup.wait_for_exit(interval=0.05) is victim
        assert sup.states["b"] == "exited"


def test_a_part_that_cannot_start_fails_start_all(tmp_path: Path) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    taken = LaunchPlan(name="taken", argv=[sys.executable, "-m", "pdkv", "bootstrap", "--host", "127.0.0.1", "--port", str(port)],
                       env={}, url="http://127.0.0.1:1")
    try:
        with Supervisor([bootstrap_plan("ok"), taken], tmp_path) as sup, pytest.raises(StartError, match="taken exited"):
            sup.start_all(timeout=30)
        assert sup.states["taken"] == "failed"
        assert sup.states["ok"] == "stopped"
    finally:
        held.close()


def test_a_broken_status_view_does_not_stop_the_shutdown(tmp_path: Path) -> None:
    sup = Supervisor([bootstrap_plan("a"), bootstrap_plan("b")], tmp_path)
    sup.start_all(timeout=30)
    pids = sup.pids()

    def broken() -> None:
        raise RuntimeError("the live view is gone")

    sup.on_change = broken
    sup.stop_all()
    assert not [p for p in pids if _alive(p)]

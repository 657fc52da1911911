"""`pdkv down` in-process against records of real processes: parts orphaned by a `pdkv up` that is gone, a stale
record, nothing recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from support.waiting import wait_for

from pdkv.cli import run
from pdkv.deploy.run.leftovers import PartRecord, UpRecord, record_path, write_record
from pdkv.deploy.run.watchdog import MARKER_ENV

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _record(log_dir: Path, marker: str, parts: list[PartRecord], pid: int = 999_999_999) -> Path:
    """A record of a `pdkv up` (pid `pid`, by default one no process has) that started `parts`."""
    path = record_path(log_dir, pid)
    write_record(path, UpRecord(pid=pid, started=0.0, command=["pdkv", "up", "-f", "deploy.toml"], cwd=str(log_dir),
                                log_dir=str(log_dir), marker=marker, parts=parts))  # fmt: skip
    return path


def _orphan(marker: str) -> subprocess.Popen[bytes]:
    """A part left behind: its own process group, the deployment's marker in its environment."""
    return subprocess.Popen(SLEEPER, env={**os.environ, MARKER_ENV: marker}, start_new_session=True)


def test_down_stops_the_parts_of_a_pdkv_up_that_is_gone(capsys, tmp_path: Path) -> None:
    part, stranger = _orphan("m-1"), subprocess.Popen(SLEEPER, start_new_session=True)
    try:
        started = psutil.Process(part.pid).create_time()
        path = _record(tmp_path, "m-1", [
            PartRecord(name="bootstrap-0", url="http://127.0.0.1:8998", ports=[("127.0.0.1", 8998)], command=SLEEPER,
                       pid=part.pid, pgid=part.pid, started=started),
            # the group number of a part that is gone, now another program's: not the deployment's
            PartRecord(name="proxy", url="http://127.0.0.1:8000", ports=[("127.0.0.1", 8000)], command=SLEEPER,
                       pid=stranger.pid, pgid=stranger.pid, started=0.0),
        ])  # fmt: skip
        code = run(["down", "--log-dir", str(tmp_path), "--grace", "5", "--json"])
        (done,) = json.loads(capsys.readouterr().out)["deployments"]
        assert code == 0 and done["stopped"] == ["bootstrap-0"] and not done["up_alive"] and not done["left"]
        assert part.wait(timeout=5) == -signal.SIGTERM and stranger.poll() is None
        assert not path.exists()
    finally:
        for proc in (part, stranger):
            proc.kill()
            proc.wait(timeout=5)


def test_a_stale_record_is_removed_and_nothing_runs(capsys, tmp_path: Path) -> None:
    path = _record(tmp_path, "m-2", [PartRecord(name="prefill-0", url="http://127.0.0.1:8100", ports=[], command=SLEEPER)])
    assert run(["down", "--log-dir", str(tmp_path)]) == 0
    assert f"nothing recorded in {tmp_path} runs" in capsys.readouterr().out and not path.exists()
    assert run(["down", "--log-dir", str(tmp_path / "never"), "--pid", "42", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deployments"] == []


def test_down_of_one_pid_leaves_the_other_deployment(capsys, tmp_path: Path) -> None:
    mine, other = _orphan("m-3"), _orphan("m-4")
    try:
        for proc, marker, pid in ((mine, "m-3", 999_999_991), (other, "m-4", 999_999_992)):
            _record(tmp_path, marker, [PartRecord(name=f"decode-{marker}", url="u", ports=[], command=SLEEPER, pid=proc.pid,
                                                  pgid=proc.pid)], pid=pid)  # fmt: skip
        assert run(["down", "--log-dir", str(tmp_path), "--pid", "999999991"]) == 0
        assert "decode-m-3" in capsys.readouterr().out
        mine.wait(timeout=5)
        wait_for(lambda: other.poll() is None, 1, "the other deployment's part to live on")
        assert record_path(tmp_path, 999_999_992).exists()
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait(timeout=5)

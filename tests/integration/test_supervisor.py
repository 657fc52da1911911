"""The deployment Supervisor over real processes on 127.0.0.1 (`pdkv bootstrap`, a small health server):
stages, health, death, restart (backoff, the give-up bound, `restart = "no"`), stop."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pdkv.deploy import PartEvent, RestartPolicy, Supervisor
from pdkv.errors import StartError
from pdkv.deploy.plan.launch import Launch
from support.ports import free_port

# A /health server; it exits with code 3 at start while the file named by PDKV_TEST_CRASH exists.
HEALTH_SERVER = (
    "import http.server, os, sys\n"
    "if os.path.exists(os.environ.get('PDKV_TEST_CRASH', '/nonexistent')):\n"
    "    print('crashing on purpose', flush=True); sys.exit(3)\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
    "    def log_message(self, *a): pass\n"
    "server = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H)\n"
    "print('serving pid', os.getpid(), 'value', os.environ['PDKV_TEST_VALUE'], flush=True)\n"
    "server.serve_forever()\n"
)


def bootstrap_plan(name: str) -> Launch:
    port = free_port()
    argv = [sys.executable, "-m", "pdkv", "bootstrap", "--host", "127.0.0.1", "--port", str(port)]
    return Launch(name=name, argv=argv, env={}, url=f"http://127.0.0.1:{port}")


def server_plan(name: str, crash_file: Path, cpus: list[int] | None = None) -> Launch:
    port = free_port()
    return Launch(name=name, argv=[sys.executable, "-c", HEALTH_SERVER, str(port)], url=f"http://127.0.0.1:{port}",
                      env={"PDKV_TEST_VALUE": f"{name}-42", "PDKV_TEST_CRASH": str(crash_file)}, cpus=cpus)


def fast(burst: int = 5, initial_s: float = 0.2) -> RestartPolicy:
    return RestartPolicy(initial_s=initial_s, max_s=2.0, burst=burst, window_s=60.0)


class Recorder:
    """The watch loop's events, each with the time it arrived."""

    def __init__(self) -> None:
        self.events: list[tuple[float, PartEvent]] = []

    def __call__(self, event: PartEvent) -> None:
        self.events.append((time.monotonic(), event))

    def kinds(self, name: str) -> list[str]:
        return [e.kind for _, e in self.events if e.name == name]

    def until(self, name: str, kinds: list[str], timeout: float = 30.0):
        deadline = time.monotonic() + timeout

        def done() -> bool:
            assert time.monotonic() < deadline, f"{name}: events {self.kinds(name)}, waited for {kinds}"
            return self.kinds(name)[: len(kinds)] == kinds and len(self.kinds(name)) >= len(kinds)

        return done


def within(done, timeout: float = 30.0):
    """`done` as a watch's `until`, failing the test once `timeout` s pass without it."""
    deadline = time.monotonic() + timeout

    def check() -> bool:
        assert time.monotonic() < deadline, "the awaited state never came"
        return done()

    return check


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


def test_restart_no_reports_the_dead_part_and_restarts_nothing(tmp_path: Path) -> None:
    events = Recorder()
    with Supervisor([bootstrap_plan("a"), bootstrap_plan("b")], tmp_path, on_event=events,
                    restart=[RestartPolicy("no"), RestartPolicy("no")]) as sup:
        sup.start_all(timeout=30)
        victim = sup.procs[1]
        pid = victim.pid
        os.kill(pid, signal.SIGKILL)
        assert sup.watch(interval=0.05) is victim  # the caller stops the rest, as before restarts existed
        assert sup.states == {"a": "ready", "b": "exited"}
        assert victim.pid == pid and not _alive(pid)
        (event,) = [e for _, e in events.events]
        assert event.kind == "exited" and event.code == -9 and "b killed by SIGKILL" in event.message


def test_a_killed_part_is_restarted_with_its_port_cores_and_env(tmp_path: Path) -> None:
    core = sorted(os.sched_getaffinity(0))[-1]
    events = Recorder()
    plans = [server_plan("a", tmp_path / "no-crash"), server_plan("b", tmp_path / "no-crash", cpus=[core])]
    with Supervisor(plans, tmp_path, on_event=events, restart=[fast(), fast()]) as sup:
        sup.start_all(timeout=30)
        b = sup.procs[1]
        first = b.pid
        os.killpg(first, signal.SIGKILL)
        assert sup.watch(interval=0.05, until=events.until("b", ["exited", "restarting", "restarted"])) is None
        assert sup.states == {"a": "ready", "b": "ready"}
        exited = next(e for _, e in events.events if e.kind == "exited")
        assert exited.code == -9 and exited.pid == first
        assert exited.message == f"b killed by SIGKILL; its log's last line: serving pid {first} value b-42"
        assert b.pid != first and not _alive(first)
        assert httpx.get(plans[1].url + "/health", timeout=5).status_code == 200  # the same port
        assert os.sched_getaffinity(b.pid) == {core}
        assert (tmp_path / "b.log").read_text().splitlines() == [f"serving pid {first} value b-42", f"serving pid {b.pid} value b-42"]
        assert sup.procs[0].poll() is None  # the other part was left alone


def test_restarts_wait_out_the_backoff(tmp_path: Path) -> None:
    events = Recorder()
    with Supervisor([server_plan("a", tmp_path / "no-crash")], tmp_path, on_event=events, restart=[fast(initial_s=0.5)]) as sup:
        sup.start_all(timeout=30)
        for n in (1, 2):
            os.killpg(sup.procs[0].pid, signal.SIGKILL)
            sup.watch(interval=0.05, until=events.until("a", ["exited", "restarting", "restarted"] * n))
        restarting = [(t, e) for t, e in events.events if e.kind == "restarting"]
        assert [e.delay_s for _, e in restarting] == [0.5, 1.0]  # doubled
        started = [t for t, e in events.events if e.kind == "restarted"]
        for (t_decided, e), t_up in zip(restarting, started, strict=True):
            assert t_up - t_decided >= e.delay_s


def test_a_part_past_the_bound_stays_failed_while_the_rest_keeps_serving(tmp_path: Path) -> None:
    crash = tmp_path / "crash"
    events = Recorder()
    plans = [server_plan("a", tmp_path / "no-crash"), server_plan("b", crash)]
    with Supervisor(plans, tmp_path, on_event=events, restart=[fast(), fast(burst=2, initial_s=0.1)]) as sup:
        sup.start_all(timeout=30)
        crash.touch()  # from now on b exits with code 3 as soon as it starts
        os.killpg(sup.procs[1].pid, signal.SIGKILL)
        sup.watch(interval=0.05, until=events.until("b", ["exited", "restarting"] * 2 + ["exited", "gave-up"]))
        assert sup.states == {"a": "ready", "b": "failed"}
        codes = [e.code for _, e in events.events if e.kind == "exited"]
        assert codes == [-9, 3, 3]
        gave_up = next(e for _, e in events.events if e.kind == "gave-up")
        assert "3 exits within 60 s" in gave_up.message and "stays down" in gave_up.message
        assert "crashing on purpose" in next(e for _, e in events.events if e.code == 3).message
        assert httpx.get(plans[0].url + "/health", timeout=5).status_code == 200
        time.sleep(0.5)
        assert sup.procs[1].poll() == 3 and len(events.events) == 6  # no restart after giving up
        # Once no part is left running, watch returns the last one that failed.
        os.killpg(sup.procs[0].pid, signal.SIGTERM)
        crash_a = Path(plans[0].env["PDKV_TEST_CRASH"])
        crash_a.touch()
        deadline = time.monotonic() + 60
        done = sup.watch(interval=0.05, until=lambda: time.monotonic() > deadline)
        assert done is sup.procs[0] and sup.states == {"a": "failed", "b": "failed"}


def test_a_restarted_part_brings_back_the_parts_that_depend_on_it(tmp_path: Path) -> None:
    events = Recorder()
    plans = [server_plan("bootstrap", tmp_path / "no-crash"), server_plan("prefill", tmp_path / "no-crash")]
    with Supervisor(plans, tmp_path, on_event=events, restart=[fast(), fast()], restart_with={"bootstrap": ["prefill"]}) as sup:
        sup.start_all(timeout=30)
        prefill_pid = sup.procs[1].pid
        os.killpg(sup.procs[0].pid, signal.SIGKILL)
        sup.watch(interval=0.05, until=events.until("prefill", ["restarting", "restarted"]))
        assert sup.states == {"bootstrap": "ready", "prefill": "ready"}
        assert sup.procs[1].pid != prefill_pid and not _alive(prefill_pid)
        assert "bootstrap restarted" in next(e for _, e in events.events if e.name == "prefill").message


def test_a_part_that_cannot_start_fails_start_all(tmp_path: Path) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    taken = Launch(name="taken", argv=[sys.executable, "-m", "pdkv", "bootstrap", "--host", "127.0.0.1", "--port", str(port)],
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


def test_parts_run_starts_stops_and_restores_the_signal_handlers(tmp_path: Path):
    """`pdkv up`'s run (pdkv.deploy.run.parts_run.PartsRun): inside the `with`, SIGTERM and SIGHUP stop like Ctrl-C; leaving
    it stops every part, puts SIGTERM's and SIGHUP's handlers back and leaves SIGINT raising KeyboardInterrupt;
    `watch` names the part that died and is not started again."""
    from pdkv.deploy.run import PartsRun
    from pdkv.deploy.plan.topology import Part
    from pdkv.errors import PdkvError

    plan = bootstrap_plan("bootstrap-0")
    part = Part(kind="bootstrap", launch=plan, ports=[], restart="no")
    before_term, before_hup = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    with PartsRun([part], tmp_path, restart="no") as run:
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
        assert signal.getsignal(signal.SIGHUP) is signal.default_int_handler
        assert run.start(30) > 0
        pid = run.supervisor.procs[0].pid
        assert httpx.get(f"{plan.url}/health", timeout=5).status_code == 200
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(PdkvError, match="bootstrap-0 exited"):
            run.watch()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert signal.getsignal(signal.SIGTERM) is before_term and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGHUP) is before_hup


def test_a_part_launched_while_watching_is_reported_started_and_a_retired_one_stays_stopped(tmp_path: Path) -> None:
    events = Recorder()
    added = server_plan("added", tmp_path / "no-crash")
    with Supervisor([bootstrap_plan("a")], tmp_path, on_event=events, restart=[fast()]) as sup:
        sup.start_all(timeout=30)
        failures: list[str] = []
        steps = iter([lambda: sup.launch(added, stage=1, on_failure=lambda proc, how: failures.append(how))])

        def every() -> None:  # the autoscaler's place: it runs on the watch thread
            step = next(steps, None)
            if step is not None:
                step()

        assert sup.watch(interval=0.05, every=every, until=events.until("added", ["started"])) is None
        assert sup.states == {"a": "ready", "added": "ready"} and httpx.get(added.url + "/health", timeout=5).status_code == 200
        pid = sup.procs[1].pid
        assert sup.retire("added", grace=5) is not None and sup.states["added"] == "stopped" and not _alive(pid)
        assert sup.watch(interval=0.05, until=lambda: True) is None  # nothing restarts a retired part
        with pytest.raises(ValueError, match="running already"):
            sup.launch(sup.procs[0].launch, stage=0, on_failure=lambda proc, how: failures.append(how))
        sup.launch(added, stage=1, on_failure=lambda proc, how: failures.append(how))  # started again: the same plan, port and log
        assert sup.watch(interval=0.05, until=events.until("added", ["started", "started"])) is None
        assert sup.procs[1].pid != pid and len(sup.procs) == 2 and "restarted" not in events.kinds("added")
        assert failures == []


def test_a_launched_part_that_fails_goes_to_its_launcher_and_never_ends_the_watch_whatever_the_restart_policy(tmp_path: Path):
    events = Recorder()
    crash = tmp_path / "crash"
    crash.touch()
    static = server_plan("static", tmp_path / "no-crash")
    added = server_plan("added", crash)
    failed: list[tuple[str, int | None, str]] = []

    def on_failure(proc, how: str) -> None:
        failed.append((proc.name, proc.poll(), how))

    # restart = "no" on the static part: a death of its own would end the watch (and the deployment)
    with Supervisor([static], tmp_path, on_event=events, restart=[RestartPolicy("no")]) as sup:
        sup.start_all(timeout=30)
        sup.launch(added, stage=1, on_failure=on_failure)
        assert sup.watch(interval=0.05, until=within(lambda: len(failed) == 1)) is None
        assert failed == [("added", 3, "exited with code 3")], events.kinds("added")
        assert sup.states == {"static": "ready", "added": "failed"} and events.kinds("added") == ["exited"]
        assert "crashing on purpose" in next(e.message for _, e in events.events if e.name == "added")
        # Started again once it can start: healthy, then killed while serving: handed over again, not restarted.
        crash.unlink()
        sup.launch(added, stage=1, on_failure=on_failure)
        assert sup.watch(interval=0.05, until=events.until("added", ["exited", "started"])) is None
        os.kill(sup.procs[1].pid, signal.SIGKILL)
        assert sup.watch(interval=0.05, until=within(lambda: len(failed) == 2)) is None
        assert failed[1] == ("added", -signal.SIGKILL, "killed by SIGKILL")
        assert sup.states == {"static": "ready", "added": "failed"} and "restarting" not in events.kinds("added")
        assert httpx.get(static.url + "/health", timeout=5).status_code == 200
        # A part whose process cannot be started at all: StartError to the launcher, at once.
        missing = Launch(name="missing", argv=[str(tmp_path / "no-such-program")], env={}, url="http://127.0.0.1:1")
        with pytest.raises(StartError, match="cannot run"):
            sup.launch(missing, stage=1, on_failure=on_failure)
        assert sup.states["missing"] == "failed" and len(failed) == 2

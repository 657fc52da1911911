"""The parts `pdkv up` starts never outlive it, on real processes: `pdkv up -f fleet.toml --host A` starting a
real bootstrap server and a real proxy (stub P and D servers of hosts B and C on 127.0.0.2 and 127.0.0.3 stand
in for the engines), sent SIGHUP, killed with SIGKILL, run in a terminal that is closed, started twice in one
place; `pdkv down`; `--role` engines sharing a log folder; and the watchdog itself: a group that ignores SIGTERM,
a process that left its part's group, a part restarted by the supervisor, a part started the way the autoscaler
starts one (Supervisor.launch)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from support.ports import free_port
from support.proxy_stubs import Stub
from support.up_events import UpEvents
from support.waiting import wait_for, waited_for

from pdkv.bootstrap import BootstrapClient
from pdkv.deploy.plan.launch import Launch
from pdkv.deploy.run.leftovers import PartRecord, raise_conflicts, read_record, record_path, write_record
from pdkv.deploy.run.lifeline import WATCHDOG_BOUND_S, Lifeline
from pdkv.deploy.run.preflight import port_free
from pdkv.deploy.run.process import ManagedProcess
from pdkv.deploy.run.restart import RestartPolicy
from pdkv.deploy.plan.startup import UpOptions, resolve
from pdkv.deploy.run.supervisor import PartEvent, Supervisor
from pdkv.errors import StartError
from pdkv.wire import RegisterRequest

READY_S = 60.0  # a bootstrap server and a proxy on a loaded 2-core host
BOUND_S = WATCHDOG_BOUND_S + 3.0  # the watchdog's own bound, and a margin for a loaded host to notice


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _family(pid: int) -> set[int]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
    return set()


class Fleet:
    """Stub P (host B) and D (host C), and the fleet file whose host A runs a bootstrap server and a proxy."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.p, self.d = Stub("p", "127.0.0.2"), Stub("d", "127.0.0.3")
        self.boot, self.proxy = free_port(), free_port()
        self.ports = [self.boot, self.proxy]
        self.file = root / "fleet.toml"
        self.logs = root / "logs"
        self.started: list[subprocess.Popen[str]] = []  # every `pdkv up` of the test, killed with what it left at its end
        self.readers: list[UpEvents] = []

    def write(self) -> None:
        self.file.write_text(textwrap.dedent(f"""
            model = "{self.root / 'model'}"
            served_model_name = "tiny"
            transport = "tcp"
            platform = "cpu"
            host = "127.0.0.1"
            restart = "no"
            [[hosts]]
            name = "A"
            address = "127.0.0.1"
            [[hosts]]
            name = "B"
            address = "127.0.0.2"
            [[hosts]]
            name = "C"
            address = "127.0.0.3"
            [bootstrap]
            host = "A"
            port = {self.boot}
            [[prefill]]
            host = "B"
            port = {self.p.service.port}
            [[decode]]
            host = "C"
            port = {self.d.service.port}
            [proxy]
            host = "A"
            port = {self.proxy}
            extra_args = ["--health-interval", "0.2"]
        """))

    def start(self) -> subprocess.Popen[str]:
        """`pdkv up -f fleet.toml --host A --json` in its own session."""
        proc = subprocess.Popen([sys.executable, "-m", "pdkv", "up", "-f", str(self.file), "--host", "A", "--json", "--log-dir",
                                 str(self.logs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.started.append(proc)
        return proc

    def ready(self, proc: subprocess.Popen[str]) -> tuple[UpEvents, dict[str, int]]:
        """`proc`'s events, once it is ready, and its parts' pids by name."""
        events = UpEvents(proc)
        self.readers.append(events)
        return events, {p["name"]: p["pid"] for p in events.wait("ready", READY_S)["parts"]}

    def register(self, stop: threading.Event) -> None:
        """Register P's engine with A's bootstrap server whenever one runs there (each `pdkv up` starts a new one)."""
        req = RegisterRequest(engine_id="engine-p", dp_rank=0, tp_rank=0, pp_rank=0, addr=f"tcp://127.0.0.2:{self.p.service.port}")
        while not stop.wait(0.1):
            with contextlib.suppress(Exception), BootstrapClient(f"http://127.0.0.1:{self.boot}", retries=0, timeout=1.0) as bs:
                bs.register(req)

    def free(self) -> bool:
        return all(port_free("127.0.0.1", port) for port in self.ports)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    stop = threading.Event()
    f.p.service.start()
    f.d.service.start()
    f.write()
    registrar = threading.Thread(target=f.register, args=(stop,), daemon=True)
    registrar.start()
    try:
        yield f
    finally:
        stop.set()
        registrar.join(timeout=5)
        left: set[int] = set()
        for proc in f.started:  # a failed test must leave nothing behind
            left |= _family(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for events in f.readers:
            events.close()
        followed = {events.proc.pid for events in f.readers}
        for proc in f.started:
            if proc.pid not in followed:
                proc.communicate(timeout=10)
        for path in f.logs.glob("pdkv-up-*.json"):
            record = read_record(path)
            left |= {p.pid for p in record.parts if p.pid} | {record.watchdog or 0} if record else set()
        for pid in left - {0}:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        f.p.service.stop()
        f.d.service.stop()


def _down(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdkv", "down", *args], check=False, capture_output=True, text=True, timeout=90)


def test_sigkill_of_pdkv_up_stops_every_part_within_the_bound_and_the_next_up_starts(fleet: Fleet) -> None:
    up = fleet.start()
    _, parts = fleet.ready(up)
    assert set(parts) == {"bootstrap-0", "proxy"}
    family = set().union(*(_family(pid) for pid in parts.values()))
    (record,) = fleet.logs.glob("pdkv-up-*.json")
    assert read_record(record).pid == up.pid and {p.pid for p in read_record(record).parts} == set(parts.values())
    os.kill(up.pid, signal.SIGKILL)
    took = waited_for(lambda: not any(_alive(pid) for pid in family) and fleet.free(), BOUND_S,
                      "every part gone and its ports free after SIGKILL of pdkv up", interval=0.05)
    print(f"\nSIGKILL of pdkv up: every part gone and its ports free after {took:.2f} s")
    wait_for(lambda: not record.exists(), 5, "the watchdog to remove the record")
    log = (fleet.logs / "watchdog.log").read_text()
    assert "stopping bootstrap-0" in log and "proxy (group" in log and "every part stopped" in log
    again = fleet.start()
    assert set(fleet.ready(again)[1]) == {"bootstrap-0", "proxy"}
    again.send_signal(signal.SIGINT)
    assert again.wait(timeout=30) == 0


def test_sighup_stops_like_sigterm_and_a_request_in_flight_finishes(fleet: Fleet) -> None:
    up = fleet.start()
    events, parts = fleet.ready(up)
    family = set().union(*(_family(pid) for pid in parts.values()))
    fleet.d.behaviour["delay"] = 1.5
    answer: dict[str, httpx.Response] = {}
    asking = threading.Thread(target=lambda: answer.setdefault("r", httpx.post(
        f"http://127.0.0.1:{fleet.proxy}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=30)))
    seen = len(fleet.d.seen)
    asking.start()
    wait_for(lambda: len(fleet.d.seen) > seen, 10, "the request to reach D")
    up.send_signal(signal.SIGHUP)
    events.wait("stopped", 30)
    asking.join(timeout=30)
    assert up.wait(timeout=30) == 0
    assert answer["r"].status_code == 200 and answer["r"].json()["choices"][0]["text"] == "d answer"
    assert not any(_alive(pid) for pid in family) and fleet.free()
    assert not list(fleet.logs.glob("pdkv-up-*.json")) and not (fleet.logs / "watchdog.log").exists()


def test_closing_the_terminal_pdkv_up_runs_in_stops_every_part(fleet: Fleet) -> None:
    """The everyday case: `pdkv up` in a terminal (a pty here, `pdkv up` its session leader) that is closed. The
    kernel sends SIGHUP, and every write to the terminal fails from then on."""
    pid, terminal = pty.fork()
    if pid == 0:  # the child: `pdkv up` with the terminal as its stdin, stdout and stderr
        os.execv(sys.executable, [sys.executable, "-m", "pdkv", "up", "-f", str(fleet.file), "--host", "A", "--log-dir",
                                  str(fleet.logs)])  # fmt: skip
    try:
        shown = b""
        deadline = time.monotonic() + READY_S
        while b"parts ready" not in shown:
            assert time.monotonic() < deadline, shown.decode(errors="replace")[-2000:]
            if select.select([terminal], [], [], 1.0)[0]:
                shown += os.read(terminal, 65536)
        family = _family(pid)
        assert len(family) >= 4  # pdkv up, its watchdog, the bootstrap server, the proxy
        os.close(terminal)
        t0 = time.monotonic()
        _, status = os.waitpid(pid, 0)
        took = waited_for(lambda: not any(_alive(p) for p in family) and fleet.free(), BOUND_S, "every part gone after the hang-up")
        print(f"\nterminal closed: pdkv up ended ({os.waitstatus_to_exitcode(status)}) and every part was gone after "
              f"{time.monotonic() - t0:.2f} s ({took:.2f} s after pdkv up)")
        assert os.waitstatus_to_exitcode(status) == 0
        assert not list(fleet.logs.glob("pdkv-up-*.json"))
        assert not (fleet.logs / "watchdog.log").exists()  # pdkv up stopped them itself
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_second_up_names_the_live_parts_and_pdkv_down_stops_them(fleet: Fleet) -> None:
    first = fleet.start()
    _, parts = fleet.ready(first)
    second = fleet.start()
    _, err = second.communicate(timeout=60)
    assert second.returncode == 3, err
    assert f"pid {first.pid}" in err and "still runs here" in err and "in use" not in err
    for name, pid in parts.items():
        assert f"{name}: pid {pid}, port " in err
    assert f"pdkv down --log-dir {fleet.logs} --pid {first.pid}" in err
    done = _down("--log-dir", str(fleet.logs), "--pid", str(first.pid), "--json")
    assert done.returncode == 0, done.stderr
    (stopped,) = json.loads(done.stdout)["deployments"]
    assert stopped["pid"] == first.pid and stopped["up_alive"] and sorted(stopped["stopped"]) == sorted(parts) and not stopped["left"]
    assert first.wait(timeout=10) == 0  # it stopped its parts itself, as on Ctrl-C
    assert not any(_alive(pid) for pid in parts.values()) and fleet.free()
    nothing = _down("--log-dir", str(fleet.logs))
    assert nothing.returncode == 0 and "nothing recorded" in nothing.stdout


def test_parts_orphaned_with_their_watchdog_are_named_and_stopped_by_pdkv_down(fleet: Fleet) -> None:
    first = fleet.start()
    _, parts = fleet.ready(first)
    (path,) = fleet.logs.glob("pdkv-up-*.json")
    record = read_record(path)
    assert record is not None and record.watchdog is not None
    os.kill(record.watchdog, signal.SIGKILL)  # nothing is left to stop them: only the record knows them
    wait_for(lambda: not _alive(record.watchdog), 5, "the watchdog to die")
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    assert all(_alive(pid) for pid in parts.values())
    second = fleet.start()
    _, err = second.communicate(timeout=60)
    assert second.returncode == 3 and "which is gone, still run here" in err and f"bootstrap-0: pid {parts['bootstrap-0']}" in err
    done = _down("--log-dir", str(fleet.logs))
    assert done.returncode == 0, done.stderr
    assert "stopped directly" in done.stdout and "bootstrap-0" in done.stdout
    assert not any(_alive(pid) for pid in parts.values()) and fleet.free() and not path.exists()


def test_role_engines_sharing_a_log_folder_clash_only_on_a_name_or_a_port(tmp_path: Path) -> None:
    """`pdkv up --role prefill` and `--role decode` side by side in one folder start; a second prefill there does not."""
    p_port, boot, d_port = free_port(), free_port(), free_port()
    role = {"host_ip": "127.0.0.1", "platform": "cpu"}
    prefill = resolve(UpOptions(role="prefill", port=p_port, bootstrap_port=boot, **role), tmp_path).parts
    with Lifeline(tmp_path, command=["pdkv", "up", "--role", "prefill"],
                  parts=[PartRecord.of(p) for p in prefill]) as line:
        engine = ManagedProcess(_plan("prefill", "import time; time.sleep(120)"), tmp_path / "prefill.log").start()
        try:
            record = read_record(line.path)
            record.pid = 999_999_999  # the record of another `pdkv up` (this process skips its own), gone since
            write_record(record_path(tmp_path, record.pid), record)
            raise_conflicts(tmp_path, resolve(UpOptions(role="decode", port=d_port, **role), tmp_path).parts)
            for other in (UpOptions(role="prefill", port=free_port(), bootstrap_port=free_port(), **role),  # the same name
                          UpOptions(role="decode", port=boot, **role)):  # P's bootstrap port
                with pytest.raises(StartError) as info:
                    raise_conflicts(tmp_path, resolve(other, tmp_path).parts)
                assert "which is gone, still run here" in info.value.message
                assert f"  prefill: pid {engine.pid}, ports {p_port}, {boot}, http://127.0.0.1:{p_port}" in info.value.message
                assert info.value.hint.startswith(f"stop it with `pdkv down --log-dir {tmp_path} --pid 999999999`")
        finally:
            engine.stop(grace=5)


# --- the watchdog on its own: a lifeline closed with its parts still adopted is what a dead `pdkv up` leaves

STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(120)\n"
# A part that starts one child in its group and one that leaves it (its own session), then prints their pids.
SPLITS = (
    "import subprocess, sys, time\n"
    "sleep = [sys.executable, '-c', 'import time; time.sleep(120)']\n"
    "inside = subprocess.Popen(sleep)\n"
    "outside = subprocess.Popen(sleep, start_new_session=True)\n"
    "print('pids', inside.pid, outside.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _plan(name: str, code: str) -> Launch:
    return Launch(name=name, argv=[sys.executable, "-c", code], env={}, url="http://127.0.0.1:1")


def test_the_watchdog_kills_what_ignores_sigterm_after_its_grace(tmp_path: Path) -> None:
    lines: list[str] = []
    with Lifeline(tmp_path, command=["pdkv", "up"], grace=0.5) as line:
        proc = ManagedProcess(_plan("stubborn", STUBBORN), tmp_path / "stubborn.log", on_line=lines.append).start()
        wait_for(lambda: "ready" in lines, 10, "the part to start")
        assert psutil.Process(proc.pid).environ()["PDKV_UP_MARKER"] == line.marker
        t0 = time.monotonic()
        assert line.close(timeout=10) == 0  # as if this process had died: the part is still adopted
    assert proc.proc.wait(timeout=5) == -signal.SIGKILL and time.monotonic() - t0 < 0.5 + 3
    assert "SIGKILL" in (tmp_path / "watchdog.log").read_text() and not line.path.exists()


def test_the_watchdog_stops_a_process_that_left_its_group(tmp_path: Path) -> None:
    lines: list[str] = []
    with Lifeline(tmp_path, command=["pdkv", "up"], grace=2) as line:
        proc = ManagedProcess(_plan("splits", SPLITS), tmp_path / "splits.log", on_line=lines.append).start()
        wait_for(lambda: any(x.startswith("pids") for x in lines), 10, "the part's children")
        inside, outside = map(int, next(x for x in lines if x.startswith("pids")).split()[1:])
        assert os.getpgid(outside) != proc.pid
        assert line.close(timeout=10) == 0
    assert proc.proc.wait(timeout=5) == -signal.SIGTERM
    wait_for(lambda: not any(_alive(pid) for pid in (inside, outside)), 5, "both children of the part to end")


def test_a_restarted_part_is_followed_under_its_new_pid(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "pdkv", "bootstrap", "--host", "127.0.0.1", "--port", str(port)]
    plan = Launch(name="bootstrap-0", argv=argv, env={}, url=f"http://127.0.0.1:{port}")
    events: list[PartEvent] = []
    with Lifeline(tmp_path, command=["pdkv", "up"], grace=2) as line:
        sup = Supervisor([plan], tmp_path, on_event=events.append, restart=[RestartPolicy(initial_s=0.1)])
        try:
            sup.start_all(timeout=30)
            old = sup.procs[0].pid
            assert old is not None
            os.kill(old, signal.SIGKILL)
            assert sup.watch(interval=0.05, until=lambda: any(e.kind == "restarted" for e in events)) is None
            new = sup.procs[0].pid
            (part,) = read_record(line.path).parts
            assert new != old and (part.pid, part.pgid) == (new, new)
            assert line.close(timeout=10) == 0  # as if `pdkv up` had died here
            assert sup.procs[0].proc.wait(timeout=5) == 0  # the bootstrap server ends cleanly on SIGTERM
        finally:
            sup.stop_all()
    log = (tmp_path / "watchdog.log").read_text()
    assert f"bootstrap-0 (group {new})" in log and str(old) not in log and not line.path.exists()


def test_a_part_the_autoscaler_adds_dies_with_pdkv_up(tmp_path: Path) -> None:
    """A process holding PartsRun (as `pdkv up` does) starts a bootstrap server, then a part by Supervisor.launch,
    the autoscaler's way to add an engine; killed with SIGKILL, it leaves nothing behind."""
    port = free_port()
    driver = textwrap.dedent(f"""
        import sys, time
        from pdkv.deploy.plan.launch import Launch
        from pdkv.deploy.plan.ports import PortUse
        from pdkv.deploy.run import PartsRun
        from pdkv.deploy.plan.topology import Part
        argv = [sys.executable, "-m", "pdkv", "bootstrap", "--host", "127.0.0.1", "--port", "{port}"]
        boot = Part(kind="bootstrap", launch=Launch(name="bootstrap-0", argv=argv, env={{}}, url="http://127.0.0.1:{port}"),
                    ports=[PortUse(part="bootstrap-0", what="bootstrap", bind="127.0.0.1", port={port}, setting="--port")])
        with PartsRun([boot], sys.argv[1], restart="no") as run:
            run.start(30)
            run.supervisor.launch(Launch(name="prefill-1", argv=[sys.executable, "-c", {SPLITS!r}], env={{}},
                                  url="http://127.0.0.1:1"), stage=1, on_failure=lambda proc, how: None)
            print("started", *run.supervisor.pids(), flush=True)
            time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver, str(tmp_path)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("started"), line
        pids = [int(x) for x in line.split()[1:]]
        added = pids[1]
        wait_for(lambda: "pids" in (tmp_path / "prefill-1.log").read_text(), 10, "the added part's children")
        family = set(pids) | {int(x) for x in (tmp_path / "prefill-1.log").read_text().split("pids", 1)[1].split()[:2]}
        assert any(p.name == "prefill-1" and p.pid == added for p in read_record(next(tmp_path.glob("pdkv-up-*.json"))).parts)
        os.kill(proc.pid, signal.SIGKILL)
        took = waited_for(lambda: not any(_alive(pid) for pid in family) and port_free("127.0.0.1", port), BOUND_S,
                          "the bootstrap server and the added part with its children to end", interval=0.05)
        print(f"\nSIGKILL of the run: the started and the added part gone after {took:.2f} s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)

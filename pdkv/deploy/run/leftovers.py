"""What a `pdkv up` started, recorded beside its logs, and what is left of it: found by the next `pdkv up` in that
place, stopped by `pdkv down`.

Each `pdkv up` keeps one record, `pdkv-up-PID.json` in its log folder (pdkv.deploy.run.lifeline writes it as parts
start and stop): its own pid and command line, the marker in its parts' environment (pdkv.deploy.run.watchdog), and
each part's name, ports, command line, pid and process group. A clean stop removes it; so does the watchdog
once it has stopped what a killed `pdkv up` left. A record whose `pdkv up` and parts are all gone is stale and
is removed by whoever reads it.

- `running(log_dir)`: the deployments recorded there that still run (pdkv up alive, or parts alive);
- `raise_conflicts(log_dir, parts)`: StartError naming each live part that holds a name or port of `parts`
  (the part's log file or its port), with its pid and the command that stops it;
- `stop_recorded(log_dir, pid, grace, timeout)`: `pdkv down`: SIGTERM to a live `pdkv up` (it stops its parts
  as on Ctrl-C, in-flight requests given their grace), or its parts' groups stopped directly when it is gone.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from pdkv.deploy.run.watchdog import deployment_groups, stop_groups
from pdkv.errors import PdkvError, StartError

if TYPE_CHECKING:
    from pdkv.deploy.plan import Part

RECORD_GLOB = "pdkv-up-*.json"
UP_STOP_S = 60.0  # `pdkv down`: how long a live `pdkv up` has to stop its parts before they are stopped directly


class PartRecord(msgspec.Struct, kw_only=True):
    """One part of a recorded deployment; `pid` and `pgid` are None until it starts. `started`: its process's start
    time (psutil's create_time), so that a pid the system gave to another program since is not taken for it."""

    name: str
    url: str
    ports: list[tuple[str, int]]
    command: list[str]
    pid: int | None = None
    pgid: int | None = None
    started: float | None = None

    @classmethod
    def of(cls, part: Part) -> PartRecord:
        """The record of a part about to start: its name, URL, the (address, port) pairs it binds, its command."""
        return cls(name=part.launch.name, url=part.launch.url, ports=ports_of(part), command=list(part.launch.argv))


def ports_of(part: Part) -> list[tuple[str, int]]:
    """(address, port) of each port `part` binds, as a record keeps them."""
    return [(use.bind, use.port) for use in part.ports]


class UpRecord(msgspec.Struct, kw_only=True):
    """One `pdkv up`: its pid, start time and command line, its working folder, its parts' marker and its watchdog."""

    pid: int
    started: float
    command: list[str]
    cwd: str
    log_dir: str
    marker: str
    watchdog: int | None = None
    parts: list[PartRecord] = []


class Running(msgspec.Struct, frozen=True, kw_only=True):
    """A recorded deployment that still runs: whether its `pdkv up` lives, and which of its parts do."""

    path: Path
    record: UpRecord
    up_alive: bool
    parts: list[PartRecord]  # alive, or (pid None) still to be started by a live `pdkv up`
    groups: frozenset[int]  # the live process groups carrying its marker


class Stopped(msgspec.Struct, frozen=True, kw_only=True):
    """`pdkv down`'s outcome for one deployment."""

    pid: int
    command: str
    up_alive: bool  # it was signalled (else its parts were stopped directly)
    stopped: list[str]  # the parts that were alive
    left: list[str]  # what is still alive after the bound: part names, or process groups
    seconds: float


def record_path(log_dir: str | Path, pid: int | None = None) -> Path:
    return Path(log_dir) / f"pdkv-up-{os.getpid() if pid is None else pid}.json"


def write_record(path: Path, record: UpRecord) -> None:
    """Replace the record at `path` at once (a reader never sees half of one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(msgspec.json.encode(record))
    os.replace(tmp, path)


def read_record(path: Path) -> UpRecord | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=UpRecord)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def same_process(pid: int, started: float | None) -> bool:
    """True when `pid` is alive (not a zombie) and is the process that started at `started` (create_time)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and (started is None or abs(proc.create_time() - started) < 0.05)
    except psutil.Error:
        return False


def _running(path: Path, record: UpRecord) -> Running | None:
    up_alive = same_process(record.pid, record.started)
    groups = frozenset(deployment_groups(record.marker, [p.pgid for p in record.parts if p.pgid is not None]))
    parts = [p for p in record.parts if (p.pgid in groups) or (p.pid is None and up_alive)]
    if not up_alive and not groups:
        return None
    return Running(path=path, record=record, up_alive=up_alive, parts=parts, groups=groups)


def running(log_dir: str | Path) -> list[Running]:
    """The deployments recorded in `log_dir` that still run, oldest first; stale records are removed."""
    found: list[Running] = []
    for path in sorted(Path(log_dir).glob(RECORD_GLOB)):
        record = read_record(path)
        if record is None or record.pid == os.getpid():
            continue
        live = _running(path, record)
        if live is None:
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        found.append(live)
    return sorted(found, key=lambda r: r.record.started)


def down_command(log_dir: str | Path, pid: int) -> str:
    """The command that stops the deployment of `pdkv up` `pid` recorded in `log_dir`."""
    return shlex.join(["pdkv", "down", "--log-dir", str(log_dir), "--pid", str(pid)])


def _describe(live: Running) -> str:
    rec = live.record
    since = time.strftime("%H:%M:%S", time.localtime(rec.started))
    who = f"`{shlex.join(rec.command)}` (pid {rec.pid}, started {since})"
    return f"{who} still runs here" if live.up_alive else f"the parts of {who}, which is gone, still run here"


def _part_line(part: PartRecord) -> str:
    pid = f"pid {part.pid}" if part.pid is not None else "not started yet"
    ports = f"port{'s' * (len(part.ports) > 1)} {', '.join(str(port) for _host, port in part.ports)}" if part.ports else ""
    return f"  {part.name}: {pid}, {ports + ', ' if ports else ''}{part.url}"


def raise_conflicts(log_dir: str | Path, parts: Sequence[Part]) -> None:
    """StartError when a deployment recorded in `log_dir` still runs a part with the name (the log file) or a port of
    one of `parts`: its pdkv up, each such part with its pid and ports, and the command that stops it."""
    names = {p.launch.name for p in parts}
    ports = {port for p in parts for _host, port in p.ports}
    for live in running(log_dir):
        clash = [p for p in live.parts if p.name in names or ports & {port for _h, port in p.ports}]
        if clash:
            lines = "\n".join(_part_line(p) for p in clash)
            raise StartError(f"{_describe(live)}, holding what this one would start:\n{lines}",
                             hint=f"stop it with `{down_command(log_dir, live.record.pid)}`, or give this one other ports and "
                                  "another --log-dir")


def _wait_gone(pid: int, started: float, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while same_process(pid, started):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _stop_one(live: Running, grace: float, timeout: float) -> Stopped:
    rec, t0 = live.record, time.monotonic()
    if live.up_alive:
        try:
            os.kill(rec.pid, signal.SIGTERM)  # as Ctrl-C: it stops its parts, proxy first, each with its grace
        except PermissionError:
            raise PdkvError(f"pdkv up (pid {rec.pid}) belongs to another user", hint="run pdkv down as that user") from None
        except ProcessLookupError:
            pass
        _wait_gone(rec.pid, rec.started, timeout)
    left = deployment_groups(rec.marker, [p.pgid for p in rec.parts if p.pgid is not None])
    if left:  # a pdkv up that is gone, or one that did not stop them within `timeout`
        left = stop_groups(left, grace)
    if same_process(rec.pid, rec.started):
        left = {*left, rec.pid}
    elif not left:
        with contextlib.suppress(OSError):
            live.path.unlink()
    by_group = {p.pgid: p.name for p in rec.parts if p.pgid is not None}
    return Stopped(pid=rec.pid, command=shlex.join(rec.command), up_alive=live.up_alive, stopped=[p.name for p in live.parts],
                   left=[by_group.get(g, "pdkv up" if g == rec.pid else f"process group {g}") for g in sorted(left)],
                   seconds=time.monotonic() - t0)


def stop_recorded(log_dir: str | Path, pid: int | None = None, *, grace: float = 10.0, timeout: float = UP_STOP_S) -> list[Stopped]:
    """Stop every deployment recorded in `log_dir` that still runs (only that of `pdkv up` `pid` when given).

    A live `pdkv up` gets SIGTERM and `timeout` s to stop its parts itself; then (or at once, when it is gone) the
    parts' process groups still alive get SIGTERM and, after `grace` s, SIGKILL. [] when nothing recorded there
    runs; PdkvError for a `pdkv up` of another user.
    """
    return [_stop_one(live, grace, timeout) for live in running(log_dir) if pid is None or live.record.pid == pid]

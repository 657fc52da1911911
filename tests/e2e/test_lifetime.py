"""A local 1P1D on the tiny model never outlives its `pdkv up`: killed with SIGKILL, or sent SIGHUP (its terminal
closed) with a request in flight, nothing of it is alive and its ports are free within the bound, and the next
`pdkv up` in that place (the same file, ports and log folder) starts cleanly; a `pdkv up` started while another
one's parts live names them, and `pdkv down` stops them. Three starts of the engines in all; the main command runs
the first (SIGKILL), the extended tier the other two.

The cheap parts of the same paths (the record, the watchdog's cases, `pdkv down` on orphans, a part added the
autoscaler's way) are tested on a bootstrap server and a proxy in tests/integration/test_up_lifetime.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from support.tiny_deployment import write_tiny_deployment
from support.up_events import UpEvents
from support.waiting import waited_for

from pdkv.deploy.run.lifeline import WATCHDOG_BOUND_S
from pdkv.deploy.run.preflight import port_free

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="CPU engines: P on core 0, D on core 1")]

READY_S = float(os.environ.get("PDKV_E2E_UP_TIMEOUT", "600"))
MUST_S = 30.0  # the promise: every part gone and its ports free within this after `pdkv up` is gone
BOUND_S = WATCHDOG_BOUND_S + 5.0  # the watchdog's own bound, and a margin for a loaded host to notice


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Place:
    """One deployment file on free ports and one log folder: every `pdkv up` of the module starts there."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.logs = root, root / "logs"
        self.file = root / "deploy.toml"
        self.ports = write_tiny_deployment(self.file, model, restart="no", max_model_len=1024)
        self.started: list[subprocess.Popen[str]] = []
        self.readers: list[UpEvents] = []
        self.seen: set[int] = set()  # every process of every deployment, for the clean-up of a failed test

    def up(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-m", "pdkv", "up", "-f", str(self.file), "--json", "--quiet", "--log-dir",
                                 str(self.logs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.started.append(proc)
        return proc

    def ready(self, proc: subprocess.Popen[str]) -> set[int]:
        """Wait for `proc`'s "ready" event; every process of its deployment then (pdkv up, watchdog, parts, their children)."""
        t0 = time.monotonic()
        events = UpEvents(proc)
        self.readers.append(events)
        try:
            events.wait("ready", READY_S)
        except AssertionError as exc:
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.logs.glob("*.log")))
            raise AssertionError(f"{exc}\n{tails}") from None
        print(f"\npdkv up ready after {time.monotonic() - t0:.1f} s")
        family = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        self.seen |= family
        return family

    def free(self) -> bool:
        return all(port_free("127.0.0.1", port) for port in self.ports.values())

    def gone(self, family: set[int], what: str) -> float:
        """Seconds until no process of `family` is alive and every port is free (AssertionError after BOUND_S)."""
        took = waited_for(lambda: not any(_alive(pid) for pid in family) and self.free(), BOUND_S, what, interval=0.05)
        print(f"{what}: {took:.2f} s")
        assert took < MUST_S
        return took


@pytest.fixture(scope="module")
def place(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Place]:
    p = Place(tmp_path_factory.mktemp("lifetime"), tiny_model)
    try:
        yield p
    finally:
        for proc in p.started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for events in p.readers:
            events.close()
        followed = {events.proc.pid for events in p.readers}
        for proc in p.started:
            if proc.pid not in followed:
                proc.communicate(timeout=10)
        for pid in p.seen:  # a failed test must not leave engines on the shared cores
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


def test_sigkill_of_pdkv_up_leaves_nothing_alive_and_every_port_free(place: Place) -> None:
    up = place.up()
    family = place.ready(up)
    assert len(family) >= 6  # pdkv up, its watchdog, bootstrap, proxy, and each engine with its engine core
    up.kill()
    place.gone(family, "SIGKILL of pdkv up: every part (engines with their workers) gone and every port free")
    log = (place.logs / "watchdog.log").read_text()
    assert all(f"{name} (group" in log for name in ("bootstrap-0", "prefill-0", "decode-0", "proxy")), log
    assert not list(place.logs.glob("pdkv-up-*.json"))


# This and the next in the extended tier (README, "Tests"): tests/integration/test_up_lifetime.py drives both paths
# (SIGHUP with a request in flight; a second up naming the live parts, pdkv down) on a bootstrap server and a proxy.
@pytest.mark.extended
def test_the_next_up_starts_cleanly_and_sighup_stops_it_letting_a_request_in_flight_finish(place: Place) -> None:
    up = place.up()
    family = place.ready(up)
    # The proxy, stopped first, lets what is in flight finish for up to its shutdown timeout (5 s); 128 tokens of the tiny
    # model take about a second here, so the proxy gets its SIGTERM while they stream.
    body = {"model": "tiny", "prompt": "The river runs north to the city", "max_tokens": 128, "ignore_eos": True, "temperature": 0,
            "stream": True}
    chunks: list[dict] = []
    hung_up, done = 0.0, False
    url = f"http://127.0.0.1:{place.ports['proxy']}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if done:
                continue
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
                if len(chunks) == 1:  # the request is in flight: the terminal closes now
                    up.send_signal(signal.SIGHUP)
                    hung_up = time.monotonic()
            done = line == "data: [DONE]"
    finished = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    streamed = time.monotonic() - hung_up
    assert done and finished == ["length"], f"{len(chunks)} chunks, the last {streamed:.1f} s after SIGHUP: {chunks[-2:]}"
    print(f"the request in flight streamed for {streamed:.2f} s after SIGHUP and finished")
    assert up.wait(timeout=60) == 0
    place.gone(family, "SIGHUP to pdkv up: every part gone and every port free")
    assert not list(place.logs.glob("pdkv-up-*.json"))


@pytest.mark.extended
def test_the_next_up_starts_cleanly_a_second_names_its_parts_and_pdkv_down_stops_them(place: Place) -> None:
    up = place.up()
    family = place.ready(up)
    second = place.up()
    _, err = second.communicate(timeout=120)
    assert second.returncode == 3, err
    for name in ("bootstrap-0", "prefill-0", "decode-0", "proxy"):
        assert f"  {name}: pid " in err
    assert f"pdkv down --log-dir {place.logs} --pid {up.pid}" in err and "in use" not in err
    t0 = time.monotonic()
    down = subprocess.run([sys.executable, "-m", "pdkv", "down", "--log-dir", str(place.logs), "--json"], check=False,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert down.returncode == 0, down.stderr
    (stopped,) = json.loads(down.stdout)["deployments"]
    assert stopped["pid"] == up.pid and stopped["up_alive"] and not stopped["left"]
    assert up.wait(timeout=10) == 0
    place.gone(family, "pdkv down: every part gone and every port free")
    print(f"pdkv down took {time.monotonic() - t0:.2f} s")

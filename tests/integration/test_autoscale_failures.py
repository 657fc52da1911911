"""The autoscaler's failure paths (pdkv.deploy.run.autoscaler) over a real Supervisor and real processes, without vLLM:
each part of a deployment file runs a `pdkv bootstrap` server under the part's name (a /health, a /metrics, a port
it binds), and a stub proxy gives the planner's signal and answers drains (support.proxy_stubs.PlannerStub).

- a drain that cannot finish is bounded by drain_timeout_s, reported with what was cut, the engine stopped and
  nothing else touched;
- an engine the autoscaler starts that cannot start (its port held) or dies is a failed scale step with its log's
  last lines, tried again after the backoff while the planner asks; the listed parts (restart = "no") serve on.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import psutil
import pytest
from support.ports import free_port
from support.proxy_stubs import PlannerStub

from pdkv.deploy import RestartPolicy, Supervisor, deployment_parts
from pdkv.deploy.run.autoscaler import Autoscaler, ScaleEvent
from pdkv.deploy.run.scale_policy import RetryBackoff
from pdkv.deploy.plan.launch import Launch
from pdkv.deploy.plan.loader import deployment_from_dict
from pdkv.deploy.plan.topology import Part

DRAIN_TIMEOUT_S = 1.5


def on_bootstraps(parts: list[Part]) -> list[Part]:
    """`parts` but the proxy, each running a `pdkv bootstrap` on a port of its own under its name."""
    out = []
    for part in (p for p in parts if p.kind != "proxy"):
        port = free_port()
        argv = [sys.executable, "-m", "pdkv", "bootstrap", "--host", "127.0.0.1", "--port", str(port)]
        out.append(msgspec.structs.replace(part, launch=Launch(name=part.launch.name, argv=argv, env={}, url=f"http://127.0.0.1:{port}")))
    return out


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Scaled:
    """A deployment of two prefills (P from 1 to 2) and one decode on bootstrap servers, its supervisor (restart "no"
    for every part) and autoscaler; `events` holds every ScaleEvent."""

    def __init__(self, tmp: Path, stub: PlannerStub) -> None:
        self.dep = deployment_from_dict({
            "model": "/m", "platform": "cpu", "transport": "cma", "host": "127.0.0.1", "host_ip": "127.0.0.1", "restart": "no",
            "bootstrap": {"port": free_port()}, "prefill": [{"port": free_port()}, {"port": free_port()}],
            "decode": [{"port": free_port()}], "proxy": {"port": free_port()},
            "autoscale": {"profile": "p.json", "ttft_ms": 300, "itl_ms": 40, "interval_s": 0.2, "drain_timeout_s": DRAIN_TIMEOUT_S,
                          "prefill": {"min": 1, "max": 2}},
        })
        self.parts = on_bootstraps(deployment_parts(self.dep))
        self.sup = Supervisor([p.launch for p in self.parts], tmp, restart=[RestartPolicy("no") for _ in self.parts])
        self.events: list[tuple[float, ScaleEvent]] = []
        self.auto = Autoscaler(self.dep, self.sup, self.parts, stub.url, tmp, on_event=lambda e: self.events.append((time.monotonic(), e)))
        self.auto.backoff["prefill"] = RetryBackoff(initial_s=0.5, max_s=1.0)

    def __enter__(self) -> Scaled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.auto.close()
        self.sup.stop_all()

    def url(self, name: str) -> str:
        return next(p.launch.url for p in self.parts if p.launch.name == name)

    def kinds(self) -> list[str]:
        return [e.kind for _, e in self.events]

    def watch_until(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout

        def until() -> bool:
            assert time.monotonic() < deadline, f"scale events {self.kinds()}, states {self.sup.states}"
            return done()

        # None: no part's exit ended the watch (it would return that part)
        assert self.sup.watch(interval=0.05, every=self.auto.tick, until=until) is None

    def untouched(self, *names: str) -> None:
        assert all(self.sup.states[n] == "ready" for n in names), self.sup.states


@pytest.fixture
def stub():
    with PlannerStub(prefill=1) as s:
        yield s


def test_a_drain_that_cannot_finish_is_bounded_reported_and_stops_that_engine_alone(tmp_path: Path, stub: PlannerStub):
    stub.in_flight = 3  # the proxy always has three requests on the engine
    run = Scaled(tmp_path, stub)
    with run:
        run.sup.start_all(timeout=30)
        pid = next(p.pid for p in run.sup.procs if p.name == "prefill-1")
        run.watch_until(lambda: "stopped" in run.kinds())
        (began, draining), (ended, stopped) = run.events
        assert (draining.kind, draining.name, draining.in_flight) == ("draining", "prefill-1", 3)
        assert stopped.name == "prefill-1" and stopped.in_flight == 3, stopped
        assert f"the drain timed out after {DRAIN_TIMEOUT_S:g} s with 3 request(s) in flight" in stopped.message
        assert DRAIN_TIMEOUT_S <= ended - began < DRAIN_TIMEOUT_S + 3
        assert run.sup.states["prefill-1"] == "stopped" and not alive(pid)
        run.untouched("bootstrap-0", "bootstrap-1", "prefill-0", "decode-0")
        assert {url for url, _ in stub.drains} == {run.url("prefill-1")}  # the proxy was asked about that engine alone


def test_an_engine_that_cannot_start_or_dies_is_a_failed_step_tried_again_while_the_rest_serve(tmp_path: Path, stub: PlannerStub):
    run = Scaled(tmp_path, stub)
    with run:
        run.sup.start_all(timeout=30)
        run.watch_until(lambda: "stopped" in run.kinds())  # desired 1: prefill-1 drains (nothing in flight) and stops
        # Another process holds prefill-1's port: asked for two again, its start fails, and the step with it.
        port = int(run.url("prefill-1").rsplit(":", 1)[1])
        with socket.socket() as holder:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the TIME_WAIT of the health checks it answered
            holder.bind(("127.0.0.1", port))
            holder.listen()
            stub.desired["prefill"] = 2
            run.watch_until(lambda: run.kinds().count("scale-failed") >= 2)
        failed = [e for _, e in run.events if e.kind == "scale-failed"]
        assert all(e.name == "prefill-1" and e.desired == 2 for e in failed), failed
        assert any("Address already in use" in line for line in failed[0].log), failed[0].log
        assert "tried again in 0.5 s" in failed[0].message and "tried again in 1 s" in failed[1].message  # the backoff, bounded
        assert run.sup.states["bootstrap-1"] == "stopped"  # the failed slot's bootstrap stops with it, to start again with it
        run.untouched("bootstrap-0", "prefill-0", "decode-0")
        # The port is free again: the next try serves.
        run.watch_until(lambda: run.sup.states["prefill-1"] == "ready" and run.sup.states["bootstrap-1"] == "ready")
        assert run.kinds()[-1] == "scale-up" and run.auto.backoff["prefill"].failures in (0, 2)
        # It dies while it drains: reported stopped with its log's last lines; nothing else is touched.
        stub.in_flight, stub.desired["prefill"] = 3, 1
        run.watch_until(lambda: run.kinds()[-1] == "draining")
        os.kill(next(p.pid for p in run.sup.procs if p.name == "prefill-1"), signal.SIGKILL)
        run.watch_until(lambda: run.kinds()[-1] == "stopped")
        _, died = run.events[-1]
        assert died.name == "prefill-1" and "killed by SIGKILL while draining" in died.message and died.log, died
        assert run.sup.states["prefill-1"] == "failed" and run.sup.states["bootstrap-1"] == "stopped"  # its slot, whole
        run.untouched("bootstrap-0", "prefill-0", "decode-0")

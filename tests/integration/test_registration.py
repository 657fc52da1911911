"""P's standing registration against a real bootstrap server on 127.0.0.1: renewed, so a restarted
(empty) bootstrap server lists P again within the interval; a bootstrap that never answers fails P's start."""

from __future__ import annotations

import socket
import time

import pytest

from pdkv.bootstrap.client import BootstrapClient
from pdkv.bootstrap.server import ProbePolicy, start_background
from pdkv.connector.registration import StandingRegistration
from pdkv.errors import StartError
from pdkv.protocol import RegisterRequest

REQ = RegisterRequest(engine_id="engine-p", dp_rank=0, tp_rank=0, pp_rank=0, addr="tcp://127.0.0.1:5555")
NO_PROBES = ProbePolicy(interval=0)  # the side channel above does not exist: no liveness sweeps here


def listed(url: str) -> bool:
    with BootstrapClient(url, timeout=2.0, retries=0) as bs:
        return any(e.engine_id == "engine-p" for e in bs.query().values())


def test_a_restarted_bootstrap_lists_p_again_within_the_interval():
    bs = start_background("127.0.0.1", 0, probe=NO_PROBES)
    port = int(bs.url.rsplit(":", 1)[1])
    reg = StandingRegistration(bs.url, REQ, interval_s=0.3)
    try:
        assert listed(bs.url)
        bs.stop()
        time.sleep(0.5)  # renewals fail meanwhile; P keeps trying
        again = start_background("127.0.0.1", port, probe=NO_PROBES)
        try:
            deadline = time.monotonic() + 3.0
            while not listed(again.url):
                assert time.monotonic() < deadline, "P was not registered again within 3 s"
                time.sleep(0.05)
        finally:
            reg.close()
            again.stop()
    finally:
        reg.close()


def test_no_bootstrap_at_start_is_a_start_error_and_interval_zero_registers_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(StartError, match="could not register"):
        StandingRegistration(dead, REQ, interval_s=0.3)
    bs = start_background("127.0.0.1", 0, probe=NO_PROBES)
    try:
        reg = StandingRegistration(bs.url, REQ, interval_s=0)
        assert reg._thread is None and listed(bs.url)
        reg.close()
    finally:
        bs.stop()

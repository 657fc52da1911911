"""Standing registrations against a real bootstrap server on 127.0.0.1: renewed, so a restarted
(empty) bootstrap server lists P again within the interval; a bootstrap that never answers fails P's start."""

from __future__ import annotations

import socket
import time

import pytest

from pdkv.bootstrap import BootstrapClient, ProbePolicy, start_background
from pdkv.connector.registration import StandingRegistration
from pdkv.errors import StartError
from pdkv.wire import MemberRecord, RegisterRequest

REQ = RegisterRequest(engine_id="engine-p", dp_rank=0, tp_rank=0, pp_rank=0, addr="tcp://127.0.0.1:5555")
REGISTER = lambda bs: bs.register(REQ)  # noqa: E731
NO_PROBES = ProbePolicy(interval=0)  # the side channel above does not exist: no liveness sweeps here


def dead_url() -> str:
    """A loopback URL nothing listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def listed(url: str) -> bool:
    with BootstrapClient(url, timeout=2.0, retries=0) as bs:
        return any(e.engine_id == "engine-p" for e in bs.query().values())


def test_a_restarted_bootstrap_lists_p_again_within_the_interval():
    bs = start_background("127.0.0.1", 0, probe=NO_PROBES)
    port = int(bs.url.rsplit(":", 1)[1])
    reg = StandingRegistration(bs.url, REGISTER, "P", interval_s=0.3)
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
    dead = dead_url()
    with pytest.raises(StartError, match="could not register"):
        StandingRegistration(dead, REGISTER, "P", interval_s=0.3)
    bs = start_background("127.0.0.1", 0, probe=NO_PROBES)
    try:
        reg = StandingRegistration(bs.url, REGISTER, "P", interval_s=0)
        assert reg._thread is None and listed(bs.url)
        reg.close()
    finally:
        bs.stop()


MEMBER = MemberRecord(member_id="engine-d", role="decode", url="http://127.0.0.1:8200", model="tiny", block_size=32,
                      transport="tcp", ttl_s=1.0)


def members(url: str) -> list[MemberRecord]:
    with BootstrapClient(url, timeout=2.0, retries=0) as bs:
        return [m.record for m in bs.members().members]


def test_a_member_is_renewed_within_its_lease_and_leaves_on_close():
    bs = start_background("127.0.0.1", 0, probe=NO_PROBES)
    try:
        reg = StandingRegistration(bs.url, lambda c: c.join(MEMBER), "D", interval_s=0.3, required=False,
                                   on_close=lambda c: c.leave(MEMBER.member_id))
        time.sleep(1.5)  # longer than the 1 s lease: only renewals keep it
        assert members(bs.url) == [MEMBER]
        reg.close()
        assert members(bs.url) == []
    finally:
        bs.stop()


def test_a_member_whose_renewals_stop_expires_and_a_missing_registry_is_not_fatal():
    dead = dead_url()
    reg = StandingRegistration(dead, lambda c: c.join(MEMBER), "D", interval_s=0.3, required=False)
    reg.close()
    bs = start_background("127.0.0.1", 0, probe=NO_PROBES)
    try:
        reg = StandingRegistration(bs.url, lambda c: c.join(MEMBER), "D", interval_s=0)
        assert members(bs.url) == [MEMBER]
        time.sleep(1.2)
        assert members(bs.url) == []
        reg.close()
    finally:
        bs.stop()

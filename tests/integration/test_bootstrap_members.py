"""The members registry of a real bootstrap server on 127.0.0.1 (pdkv's extension beside vLLM's
/register and /query): join, renew, leave, expire; bad records and missing tokens change nothing."""

from __future__ import annotations

import time

import httpx
import pytest

from pdkv.bootstrap import BootstrapClient, ProbePolicy, start_background
from pdkv.errors import RemoteError
from pdkv.wire import MemberRecord

NO_SWEEP = ProbePolicy(timeout=0.3, interval=0)
P = {"member_id": "eng-p", "role": "prefill", "url": "http://198.18.0.2:8100", "bootstrap_url": "http://198.18.0.2:8998",
     "model": "tiny", "block_size": 32, "transport": "tcp"}
D = {"member_id": "eng-d", "role": "decode", "url": "http://198.18.0.3:8200", "model": "tiny", "block_size": 32, "transport": "tcp"}


@pytest.fixture
def http():
    with start_background(probe=NO_SWEEP) as svc, httpx.Client(base_url=svc.url, timeout=5, trust_env=False) as client:
        yield client


def listed(http: httpx.Client) -> list[str]:
    return [m["record"]["member_id"] for m in http.get("/pdkv/members").json()["members"]]


def test_join_renew_leave_and_query_stays_vllms(http):
    assert http.post("/pdkv/members", json=P).json() == {"status": "ok", "result": "joined"}
    assert http.post("/pdkv/members", json=D).json()["result"] == "joined"
    assert http.post("/pdkv/members", json=D).json()["result"] == "renewed"
    assert http.post("/pdkv/members", json={**D, "block_size": 16}).json()["result"] == "changed"
    body = http.get("/pdkv/members").json()
    assert [m["record"]["role"] for m in body["members"]] == ["decode", "prefill"]
    assert 14 < body["members"][0]["expires_in_s"] <= 15
    assert http.get("/query").json() == {}  # members are not vLLM's DP-rank table
    assert http.post("/pdkv/members/leave", json={"member_id": "eng-d"}).json() == {"status": "ok", "removed": 1}
    assert http.post("/pdkv/members/leave", json={"member_id": "eng-d"}).json()["removed"] == 0
    assert listed(http) == ["eng-p"]
    assert "pdkv_bootstrap_members 1.0" in http.get("/metrics").text


@pytest.mark.parametrize(
    ("raw", "status", "needle"),
    [
        (b"{", 400, "not valid JSON"),
        (b'{"member_id": "x", "role": "prefill", "url": "http://a:1"}', 422, "needs bootstrap_url"),
        (b'{"member_id": "x", "role": "router", "url": "http://a:1"}', 422, "role"),
        (b'{"member_id": "x", "role": "decode", "url": "ftp://a:1"}', 422, "http://HOST:PORT"),
        (b'{"member_id": "x", "role": "decode", "url": "http://a:1", "dp_rank": 2, "dp_size": 2}', 422, "dp_rank"),
        (b'{"member_id": "x", "role": "decode", "url": "http://a:1", "ttl_s": 0.1}', 422, "ttl_s"),
        (b'{"member_id": "", "role": "decode", "url": "http://a:1"}', 422, "member_id"),
    ],
)
def test_bad_records_are_refused_with_a_reason_and_change_nothing(http, raw, status, needle):
    http.post("/pdkv/members", json=D)
    before = http.get("/pdkv/members").json()["version"]
    r = http.post("/pdkv/members", content=raw)
    assert r.status_code == status and needle in r.json()["detail"]
    after = http.get("/pdkv/members").json()
    assert after["version"] == before and [m["record"]["member_id"] for m in after["members"]] == ["eng-d"]


def test_a_lease_that_is_not_renewed_expires():
    with start_background(probe=NO_SWEEP) as svc, BootstrapClient(svc.url) as bs:
        bs.join(MemberRecord(member_id="short", role="decode", url="http://198.18.0.3:8200", ttl_s=1.0))
        bs.join(MemberRecord(member_id="long", role="decode", url="http://198.18.0.4:8200"))
        time.sleep(1.1)
        assert [m.record.member_id for m in bs.members().members] == ["long"]


def test_the_token_guards_join_and_leave_but_not_the_list():
    with start_background(token="s3cret", probe=NO_SWEEP) as svc:
        with BootstrapClient(svc.url) as anonymous:
            with pytest.raises(RemoteError) as info:
                anonymous.join(MemberRecord(member_id="d", role="decode", url="http://198.18.0.3:8200"))
            assert info.value.status == 401
            with BootstrapClient(svc.url, token="s3cret") as client:
                client.join(MemberRecord(member_id="d", role="decode", url="http://198.18.0.3:8200"))
            with pytest.raises(RemoteError):
                anonymous.leave("d")
            assert [m.record.member_id for m in anonymous.members().members] == ["d"]


def test_a_leave_cut_mid_body_logs_no_traceback_and_changes_nothing(caplog):
    import logging
    import socket

    with start_background(probe=NO_SWEEP) as svc, httpx.Client(base_url=svc.url, timeout=5, trust_env=False) as http:
        assert http.post("/pdkv/members", json=D).json()["result"] == "joined"
        host, port = svc.url.split("//", 1)[1].rsplit(":", 1)
        with caplog.at_level(logging.INFO):
            # An engine killed as it leaves: the headers promise 100 bytes, 10 come, then the connection closes.
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"POST /pdkv/members/leave HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n" + b'{"member_i')
            deadline = time.monotonic() + 5
            while "closed the connection before its body arrived" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "closed the connection before its body arrived" in caplog.text
        assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)
        assert listed(http) == ["eng-d"]

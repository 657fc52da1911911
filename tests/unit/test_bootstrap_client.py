"""The bootstrap clients' one retry rule (`_Attempts`), without sockets: both clients drive it."""

from __future__ import annotations

import httpx
import pytest

from pdkv.bootstrap.client import _Attempts, backoff_delay
from pdkv.errors import RegistryConflict, RemoteError, UnreachableError

URL = "http://10.0.0.2:8998"


def test_delays_none_before_the_first_attempt_then_backoff():
    assert list(_Attempts(URL, "GET", "/query", 4).delays()) == [0.0, backoff_delay(0), backoff_delay(1), backoff_delay(2)]
    assert list(_Attempts(URL, "GET", "/query", 1).delays()) == [0.0]


def test_retries_transport_errors_and_502_to_504_then_names_the_last():
    plan = _Attempts(URL, "GET", "/query", 3)
    assert plan.settle(httpx.ConnectError("refused")) is None
    assert plan.settle(httpx.Response(503)) is None
    err = plan.exhausted()
    assert isinstance(err, UnreachableError)
    assert err.message == f"bootstrap at {URL} did not answer GET /query after 3 attempts (HTTP 503)"


def test_an_answer_ends_the_attempts():
    ok = httpx.Response(200, json={})
    assert _Attempts(URL, "GET", "/query", 3).settle(ok) is ok
    with pytest.raises(RegistryConflict):
        _Attempts(URL, "POST", "/register", 3).settle(httpx.Response(409, json={"detail": "taken"}))
    with pytest.raises(RemoteError, match=r"\(401\): nope"):
        _Attempts(URL, "POST", "/register", 3).settle(httpx.Response(401, json={"detail": "nope"}))

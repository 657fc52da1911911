"""The deployment key's pure parts: sealed frames, the nonce cache, bearer checks, and bound transfers in P's table."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdkv.auth import TRAILER, FrameSealer, NonceCache, bearer_ok, binding_matches, new_binding, token_from_env
from pdkv.connector.send_table import Phase, Reply, SendTable, StartSend
from pdkv.errors import ConfigError


def test_a_sealed_frame_opens_once_and_only_with_the_same_key_and_direction():
    a, b = FrameSealer("k1"), FrameSealer("k1")
    frame = a.seal(b"hello", b"q")
    assert len(frame) == 5 + TRAILER.size
    assert b.open(frame, b"r") == (None, "unauthenticated")  # a reply cannot pass as a request
    assert FrameSealer("k2").open(frame, b"q") == (None, "unauthenticated")
    assert b.open(frame, b"q") == (b"hello", "")
    assert b.open(frame, b"q") == (None, "replayed")
    tampered = bytearray(a.seal(b"hello", b"q"))
    tampered[0] ^= 1
    assert b.open(bytes(tampered), b"q") == (None, "unauthenticated")
    assert b.open(b"short", b"q") == (None, "unauthenticated")


def test_a_frame_older_or_newer_than_the_bound_is_stale(monkeypatch):
    import pdkv.auth as auth

    s = FrameSealer("k", max_age_s=30)
    now = 1_800_000_000 * 10**9
    monkeypatch.setattr(auth.time, "time_ns", lambda: now)
    old = s.seal(b"x", b"q")
    monkeypatch.setattr(auth.time, "time_ns", lambda: now + 31 * 10**9)
    assert s.open(old, b"q") == (None, "stale")
    future = s.seal(b"x", b"q")
    monkeypatch.setattr(auth.time, "time_ns", lambda: now)
    assert s.open(future, b"q") == (None, "stale")


def test_the_nonce_cache_forgets_by_age_and_by_size_without_ever_admitting_a_replay():
    c = NonceCache(capacity=3, max_age_s=10)
    s = 10**9
    for i in range(3):
        assert c.admit(b"n%d" % i, (100 + i) * s, 105 * s)
    assert not c.admit(b"n0", 100 * s, 105 * s)
    assert c.admit(b"n3", 104 * s, 105 * s)  # over capacity: n0 goes, the floor rises to its clock
    assert len(c) == 3 and c.floor_ns == 100 * s
    assert not c.admit(b"n0", 100 * s, 105 * s)  # forgotten, but at the floor: still refused
    assert c.admit(b"n9", 200 * s, 200 * s)  # the old ones aged out
    assert len(c) == 1


def test_bearer_tokens_and_the_key_from_the_environment():
    assert bearer_ok("Bearer sk-1", ("sk-0", "sk-1")) and bearer_ok("bearer  sk-1 ", "sk-1")
    assert not bearer_ok("Bearer sk-2", ("sk-0", "sk-1")) and not bearer_ok(None, "x") and not bearer_ok("Basic sk-1", "sk-1")
    assert token_from_env({"PDKV_TOKEN": "a", "PDKV_BOOTSTRAP_TOKEN": "b"}) == "a"
    with pytest.raises(ConfigError, match="PDKV_BOOTSTRAP_TOKEN is set and PDKV_TOKEN is not: pdkv reads the .* from PDKV_TOKEN only"):
        token_from_env({"PDKV_BOOTSTRAP_TOKEN": "b"})
    assert token_from_env({"PDKV_TOKEN": ""}) is None


@dataclass
class Msg:
    d_req_id: str
    binding: str


@dataclass
class Parked:
    request: Msg


@pytest.fixture
def bound() -> tuple[SendTable, str]:
    secret, commitment = new_binding()
    assert binding_matches(secret, commitment)
    t = SendTable()
    t.bind("x1", commitment)
    return t, secret


def test_a_pull_without_the_binding_is_refused_and_leaves_the_transfer_to_its_d(bound):
    t, secret = bound
    t.registered("x1", "p1", 0.0)
    t.ready("x1", "p1", [1, 2], 0.0)
    (refused,) = t.pull("x1", Parked(Msg("stranger", new_binding()[0])), 0.1)
    assert isinstance(refused, Reply) and "binding" in refused.error
    assert t.entries["x1"].phase is Phase.READY and t.entries["x1"].claimed == 0
    assert t.released("x1", 0.2, "stranger", proof=Msg("stranger", "")) == []  # a release must prove it too
    assert t.entries["x1"].served == 0
    (start,) = t.pull("x1", Parked(Msg("d1", secret)), 0.3)
    assert isinstance(start, StartSend) and start.blocks == [1, 2]


def test_pulls_parked_before_the_binding_came_are_sifted_when_it_does():
    secret, commitment = new_binding()
    t = SendTable()
    stranger, mine = Parked(Msg("d1", new_binding()[0])), Parked(Msg("d1", secret))  # even under D's own request id
    assert t.pull("x1", stranger, 0.0) == [] and t.pull("x1", mine, 0.0) == []
    t.bind("x1", commitment)
    actions = t.registered("x1", "p1", 0.1)
    assert [a.pull for a in actions if isinstance(a, Reply)] == [stranger]
    (start,) = t.ready("x1", "p1", [3], 0.2)
    assert isinstance(start, StartSend) and start.pull is mine


def test_an_unbound_transfer_serves_any_pull_as_before():
    t = SendTable()
    t.registered("x1", "p1", 0.0)
    t.ready("x1", "p1", [1], 0.0)
    (start,) = t.pull("x1", Parked(Msg("d1", "")), 0.1)
    assert isinstance(start, StartSend)

"""The socket transport's wire, pure: frame heads, the WRITE body, the handshake's proofs, the grants, the split."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdkv.errors import TransferError
from pdkv.transport.sockets import wire
from pdkv.transport.sockets.lanes import parse_session, split
from pdkv.transport.sockets.streams import HostSpans


def test_a_head_is_read_back_and_anything_else_is_refused():
    assert wire.read_head(wire.head(wire.Kind.ACK, 16), (wire.Kind.ACK,)) == (wire.Kind.ACK, 16)
    bad = {
        "magic": b"XXXX" + wire.head(wire.Kind.ACK, 16)[4:],
        "version": wire.HEAD.pack(wire.MAGIC, 2, wire.Kind.ACK, 0, 16),
        "flags": wire.HEAD.pack(wire.MAGIC, 1, wire.Kind.ACK, 1, 16),
        "where": wire.head(wire.Kind.WRITE, 16),
        "at most": wire.head(wire.Kind.ACK, 17),
    }
    for why, data in bad.items():
        with pytest.raises(wire.FrameError, match=why):
            wire.read_head(data, (wire.Kind.ACK,))
    with pytest.raises(wire.FrameError, match="at most"):
        wire.read_head(wire.head(wire.Kind.WRITE, wire.MAX_BODY + 1), (wire.Kind.WRITE,))
    # A handshake or ACK body shorter than its one size is refused at the head, before anything unpacks it.
    for kind in wire.FIXED_BODY - {wire.Kind.READY}:
        with pytest.raises(wire.FrameError, match="always"):
            wire.read_head(wire.head(kind, wire.BODY_LIMIT[kind] - 1), (kind,))
    assert wire.read_head(wire.head(wire.Kind.HELLO, wire.HELLO.size), (wire.Kind.HELLO,)) == (wire.Kind.HELLO, wire.HELLO.size)


def test_a_write_body_round_trips_and_every_inconsistent_length_is_refused():
    ranges = [(0x1000, 64), (2**64 - 8, 8)]
    body = wire.write_body(7, "key", ranges)
    assert wire.parse_write(body) == (7, "key", ranges)
    with pytest.raises(wire.FrameError):
        wire.parse_write(body[:-1])
    with pytest.raises(wire.FrameError):
        wire.parse_write(body + b"\0")
    with pytest.raises(wire.FrameError, match="empty or wraps"):
        wire.parse_write(wire.write_body(1, "k", [(2**64 - 8, 9)]))
    with pytest.raises(wire.FrameError, match="empty or wraps"):
        wire.parse_write(wire.write_body(1, "k", [(16, 0)]))
    with pytest.raises(wire.FrameError, match="does not fit"):
        wire.write_body(1, "k" * 256, ranges)
    with pytest.raises(wire.FrameError, match="does not fit"):
        wire.write_body(1, "k", [])
    with pytest.raises(wire.FrameError, match="UTF-8"):
        wire.parse_write(wire.WRITE_HEAD.pack(1, 1) + b"\xff" + wire.COUNT.pack(1) + wire.RANGE.pack(0, 1))
    # A count that claims more ranges than the body holds.
    with pytest.raises(wire.FrameError, match="announces"):
        wire.parse_write(wire.WRITE_HEAD.pack(1, 1) + b"k" + wire.COUNT.pack(3) + wire.RANGE.pack(0, 1))


def test_proofs_bind_the_key_the_side_the_session_and_both_nonces():
    key = wire.handshake_key("deployment-key")
    args = (b"s" * 16, b"p" * 16, b"d" * 16)
    given = wire.proof(key, b"d", *args)
    assert wire.proof_ok(key, b"d", *args, given)
    assert not wire.proof_ok(key, b"p", *args, given)
    assert not wire.proof_ok(wire.handshake_key("other"), b"d", *args, given)
    assert not wire.proof_ok(key, b"d", b"t" * 16, *args[1:], given)
    assert not wire.proof_ok(key, b"d", args[0], b"q" * 16, args[2], given)
    assert wire.handshake_key(None) == b"" and wire.handshake_key("k") != b""


def test_grants_admit_only_ranges_inside_one_granted_span():
    g = wire.Grants()
    g.grant("a", [(100, 50), (150, 50), (400, 10)])  # the first two touch: one span 100..200
    assert g.refusal("a", [(100, 100), (400, 10), (120, 1)]) is None
    assert "outside" in g.refusal("a", [(190, 20)])
    assert "outside" in g.refusal("a", [(99, 2)])
    assert "outside" in g.refusal("a", [(300, 1)])
    assert "no transfer 'b'" in g.refusal("b", [(100, 1)])
    g.revoke("a")
    assert "no transfer" in g.refusal("a", [(100, 1)]) and len(g) == 0


def test_a_transfer_splits_into_nearly_equal_shares_in_order():
    ranges = [(0, 1000, 10 << 20), (50 << 20, 60 << 20, 2 << 20)]
    shares = split(ranges, 4)
    assert len(shares) == 4
    assert [sum(n for _, _, n in s) for s in shares] == [3 << 20] * 4
    flat = [r for s in shares for r in s]
    assert flat[0] == (0, 1000, 3 << 20) and flat[-1][0] + flat[-1][2] == (50 << 20) + (2 << 20)
    assert sum(n for _, _, n in flat) == 12 << 20
    # Few bytes: one connection carries them.
    assert split([(0, 0, 4096), (8192, 8192, 4096)], 4) == [[(0, 0, 4096), (8192, 8192, 4096)]]


def _split_one_range_at_a_time(ranges, lanes, min_share):
    # The plain statement of the split, range by range, that `split` must agree with.
    total = sum(n for _, _, n in ranges)
    count = max(1, min(lanes, total // min_share))
    target = -(-total // count)
    shares, room = [[]], target
    for src, dst, length in ranges:
        off = 0
        while off < length:
            if room == 0:
                shares.append([])
                room = target
            n = min(room, length - off)
            shares[-1].append((src + off, dst + off, n))
            off += n
            room -= n
    return [s for s in shares if s]


def test_the_split_agrees_with_cutting_range_by_range_for_any_lengths():
    rng = random.Random(5)
    for _ in range(300):
        ranges = [(rng.randrange(1 << 40), rng.randrange(1 << 40), rng.choice([0, 1, rng.randrange(1, 5000)]))
                  for _ in range(rng.randrange(1, 60))]
        lanes, min_share = rng.randint(1, 6), rng.choice([1, 100, 4096])
        assert split(ranges, lanes, min_share) == _split_one_range_at_a_time(ranges, lanes, min_share), (ranges, lanes, min_share)
    assert split([], 4) == [] and split([(0, 0, 0)], 4) == []


def test_spans_find_the_first_range_outside_them():
    spans = wire.Spans([(100, 50), (150, 50), (400, 10)])
    assert spans.spans == [(100, 100), (400, 10)]
    assert spans.outside([(100, 100), (400, 10), (199, 1)]) is None
    assert spans.outside([(100, 1), (199, 2), (90, 5)]) == (199, 2)
    assert spans.outside([(0, 1)]) == (0, 1) and spans.outside([(120, 0)]) == (120, 0)
    assert wire.Spans().outside([(100, 1)]) == (100, 1) and wire.Spans().outside([]) is None


def test_host_spans_give_views_of_registered_memory_and_refuse_ranges_past_it():
    mem = np.arange(256, dtype=np.uint8)
    base = mem.ctypes.data
    host = HostSpans(wire.Spans([(base, 64), (base + 128, 128)]).spans)
    a, b = host.views([(base + 10, 5), (base + 200, 56)])
    assert bytes(a) == bytes(range(10, 15)) and bytes(b) == bytes(range(200, 256))
    b[0] = 7  # the views are the memory, not copies
    assert mem[200] == 7
    for addr, n in ((base + 60, 8), (base + 64, 1), (base - 1, 1), (base + 250, 7)):
        with pytest.raises(TransferError, match="not inside"):
            host.views([(addr, n)])


def test_session_addresses():
    assert parse_session(f"socket://10.0.0.2:5555/{'ab' * 16}") == ("10.0.0.2", 5555, bytes.fromhex("ab" * 16))
    assert parse_session(f"socket://[::1]:5555/{'ab' * 16}")[0] == "::1"
    for bad in ("127.0.0.1:5555", f"socket://h:0/{'ab' * 16}", "socket://h:1/abc", f"socket://:1/{'ab' * 16}", "cma:x:1:2"):
        with pytest.raises(TransferError, match="same mooncake_protocol"):
            parse_session(bad)

"""The socket transport's wire: frames, the handshake's proofs, and what D checks a write against. Pure: no sockets.

Every frame opens with a 12-byte head: magic `PDKS`, version (1), kind, flags (0), body length (big endian);
the body follows. docs/socket.md is the reference: the handshake, the write frame, what is checked and when.

    HELLO      P -> D  session id (16 B), P's nonce (16 B)
    CHALLENGE  D -> P  D's nonce (16 B), D's proof (32 B)
    PROOF      P -> D  P's proof (32 B)
    READY      D -> P  (empty): the connection takes writes
    WRITE      P -> D  sequence (8 B), key length (2 B), key, count (4 B), count x (address 8 B, length 8 B);
                       then the payload: the ranges' bytes in order, sum(length) bytes, outside the frame
    ACK        D -> P  sequence (8 B), bytes landed (8 B)
    REFUSE     D -> P  why (UTF-8); D closes the connection after it
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import itertools
import struct
import threading
from collections.abc import Iterable, Sequence
from enum import IntEnum

from pdkv.auth import derive_key
from pdkv.errors import FrameError


MAGIC = b"PDKS"
VERSION = 1
HEAD = struct.Struct(">4sBBHI")  # magic, version, kind, flags, body length
SESSION_ID_BYTES = 16
NONCE_BYTES = 16
PROOF_BYTES = 32
HELLO = struct.Struct(f">{SESSION_ID_BYTES}s{NONCE_BYTES}s")
CHALLENGE = struct.Struct(f">{NONCE_BYTES}s{PROOF_BYTES}s")
PROOF = struct.Struct(f">{PROOF_BYTES}s")
WRITE_HEAD = struct.Struct(">QH")  # sequence, key length
COUNT = struct.Struct(">I")
RANGE = struct.Struct(">QQ")  # address, length
ACK = struct.Struct(">QQ")  # sequence, bytes landed
MAX_KEY_BYTES = 255
MAX_RANGES = 65_536  # ranges in one WRITE frame; a longer write is cut into several frames
MAX_REASON_BYTES = 1024
MAX_BODY = WRITE_HEAD.size + MAX_KEY_BYTES + COUNT.size + MAX_RANGES * RANGE.size


class Kind(IntEnum):
    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    READY = 4
    WRITE = 5
    ACK = 6
    REFUSE = 7


# The largest body each kind may carry: D and P refuse a head announcing more before reading a byte of the body.
BODY_LIMIT = {
    Kind.HELLO: HELLO.size, Kind.CHALLENGE: CHALLENGE.size, Kind.PROOF: PROOF.size, Kind.READY: 0,
    Kind.WRITE: MAX_BODY, Kind.ACK: ACK.size, Kind.REFUSE: MAX_REASON_BYTES,
}

# The kinds whose body has one size: a head announcing another is refused, so no body is unpacked short.
FIXED_BODY = frozenset({Kind.HELLO, Kind.CHALLENGE, Kind.PROOF, Kind.READY, Kind.ACK})


def head(kind: Kind, body_len: int) -> bytes:
    return HEAD.pack(MAGIC, VERSION, kind, 0, body_len)


def frame(kind: Kind, body: bytes = b"") -> bytes:
    return head(kind, len(body)) + body


def read_head(data: bytes, expect: Iterable[Kind]) -> tuple[Kind, int]:
    """(kind, body length) of a 12-byte head; FrameError for a wrong magic, version or kind, a body too long, or a
    handshake or ACK body of any size but its own."""
    magic, version, kind, flags, length = HEAD.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"not a pdkv socket frame (magic {magic!r})")
    if version != VERSION:
        raise FrameError(f"socket frame version {version}, this side speaks {VERSION}")
    wanted = tuple(expect)
    if kind not in wanted:
        raise FrameError(f"frame kind {kind} where {'/'.join(k.name for k in wanted)} was due")
    if flags != 0:
        raise FrameError(f"frame flags {flags:#x} are not defined in version {VERSION}")
    if length > BODY_LIMIT[Kind(kind)]:
        raise FrameError(f"{Kind(kind).name} body of {length} B, at most {BODY_LIMIT[Kind(kind)]} B")
    if kind in FIXED_BODY and length != BODY_LIMIT[Kind(kind)]:
        raise FrameError(f"{Kind(kind).name} body of {length} B, where it is always {BODY_LIMIT[Kind(kind)]} B")
    return Kind(kind), length


# --- the handshake ----------------------------------------------------------------------------------------------


def handshake_key(token: str | None) -> bytes:
    """The key of the handshake's proofs: derived from the deployment key; without one, empty (the proofs then bind
    the connection to D's session id alone, which P learns only from D's announcement)."""
    return derive_key(token, b"socket/v1") if token else b""


def proof(key: bytes, side: bytes, session_id: bytes, p_nonce: bytes, d_nonce: bytes) -> bytes:
    """HMAC-SHA256 over the side (b"d" or b"p"), D's session id and both nonces."""
    return hmac.new(key, side + session_id + p_nonce + d_nonce, hashlib.sha256).digest()


def proof_ok(key: bytes, side: bytes, session_id: bytes, p_nonce: bytes, d_nonce: bytes, given: bytes) -> bool:
    return hmac.compare_digest(proof(key, side, session_id, p_nonce, d_nonce), given)


# --- the write frame --------------------------------------------------------------------------------------------


def write_body(seq: int, key: str, ranges: Sequence[tuple[int, int]]) -> bytes:
    raw = key.encode()
    if len(raw) > MAX_KEY_BYTES or len(ranges) > MAX_RANGES or not ranges:
        raise FrameError(f"a write of {len(ranges)} ranges under a {len(raw)}-byte key does not fit one frame")
    # One pack of every (address, length) rather than one per range: scattered blocks make thousands of ranges.
    table = struct.pack(f">{2 * len(ranges)}Q", *itertools.chain.from_iterable(ranges))
    return WRITE_HEAD.pack(seq, len(raw)) + raw + COUNT.pack(len(ranges)) + table


def parse_write(body: bytes) -> tuple[int, str, list[tuple[int, int]]]:
    """(sequence, key, ranges) of a WRITE body; FrameError unless its lengths add up exactly and every range is
    non-empty and inside 0..2**64."""
    if len(body) < WRITE_HEAD.size + COUNT.size:
        raise FrameError(f"WRITE body of {len(body)} B is shorter than its fixed fields")
    seq, key_len = WRITE_HEAD.unpack_from(body)
    at = WRITE_HEAD.size + key_len
    if key_len > MAX_KEY_BYTES or at + COUNT.size > len(body):
        raise FrameError(f"WRITE key of {key_len} B does not fit its body")
    try:
        key = body[WRITE_HEAD.size : at].decode()
    except UnicodeDecodeError:
        raise FrameError("WRITE key is not UTF-8") from None
    (count,) = COUNT.unpack_from(body, at)
    at += COUNT.size
    if count == 0 or count > MAX_RANGES or at + count * RANGE.size != len(body):
        raise FrameError(f"WRITE announces {count} ranges in {len(body) - at} B")
    ranges = list(RANGE.iter_unpack(memoryview(body)[at:]))
    for addr, length in ranges:
        if length == 0 or addr + length > 1 << 64:
            raise FrameError(f"WRITE range {addr:#x}+{length} is empty or wraps")
    return seq, key, ranges


# --- what D lets be written -------------------------------------------------------------------------------------


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, length) spans sorted and merged where they touch or overlap."""
    out: list[tuple[int, int]] = []
    for addr, length in sorted((a, n) for a, n in spans if n > 0):
        if out and addr <= out[-1][0] + out[-1][1]:
            start, n = out[-1]
            out[-1] = (start, max(start + n, addr + length) - start)
        else:
            out.append((addr, length))
    return out


class Spans:
    """Merged (address, length) spans and what is asked of them: whether ranges lie inside them. Immutable: an owner
    that changes its spans replaces the whole object."""

    __slots__ = ("_ends", "_starts", "spans")

    def __init__(self, spans: Iterable[tuple[int, int]] = ()) -> None:
        self.spans = merge_spans(spans)
        self._starts = [a for a, _ in self.spans]
        self._ends = [a + n for a, n in self.spans]

    def outside(self, ranges: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
        """The first (address, length) of `ranges` that is empty or not inside one span, or None when all are inside."""
        starts, ends, find = self._starts, self._ends, bisect.bisect_right  # one loop over thousands of ranges
        for addr, length in ranges:
            i = find(starts, addr) - 1
            if length <= 0 or i < 0 or addr + length > ends[i]:
                return addr, length
        return None


class Grants:
    """What peers may write, by key: the spans D announced for one transfer, each inside registered memory.

    Safe from any thread: `_lock` guards the table; a check reads one key's Spans, which are replaced whole.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, Spans] = {}  # guarded by _lock

    def grant(self, key: str, spans: Iterable[tuple[int, int]]) -> None:
        granted = Spans(spans)
        with self._lock:
            self._by_key[key] = granted

    def revoke(self, key: str) -> None:
        with self._lock:
            self._by_key.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    def refusal(self, key: str, ranges: Sequence[tuple[int, int]]) -> str | None:
        """Why a write of `ranges` under `key` is refused, or None when every range lies inside the key's spans."""
        with self._lock:
            granted = self._by_key.get(key)
        if granted is None:
            return f"no transfer {key[:80]!r} is expected here (unknown, concluded or never announced)"
        bad = granted.outside(ranges)
        if bad is not None:
            return f"range {bad[0]:#x}+{bad[1]} lies outside what transfer {key[:80]!r} announced"
        return None

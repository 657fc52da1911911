"""The deployment key: one secret per deployment, and what is built from it.

Where it comes from: env PDKV_TOKEN, the deployment file's `token` key, or a
Kubernetes Secret mounted into that env var. PDKV_BOOTSTRAP_TOKEN, a name pdkv
no longer reads, set without PDKV_TOKEN is a ConfigError: a key left there
would otherwise leave the deployment open without a word. Its uses:

- the bootstrap's write endpoints and the proxy's admin surface take it as a bearer token;
- every side-channel frame is sealed with it (`FrameSealer`): the frame's
  bytes, then a 16-byte random nonce, the sender's clock in nanoseconds and
  an HMAC-SHA256 over the direction, nonce, clock and bytes. The receiver
  drops a frame whose tag is wrong, whose clock is more than MAX_AGE_S away
  from its own, or whose nonce it has seen (`NonceCache`);
- the socket transport's handshake proves both ends hold it (`derive_key`, pdkv.transport.sockets.wire);
- per-transfer binding (`new_binding`, `binding_matches`): the proxy gives D
  a random secret and P only its SHA-256, so that P can tell the D the
  proxy chose from any other peer (docs/security.md).

Pure apart from the clock and the random source: no sockets.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict

from pdkv.errors import ConfigError

log = logging.getLogger("pdkv.auth")

TOKEN_ENV = "PDKV_TOKEN"
RETIRED_TOKEN_ENV = "PDKV_BOOTSTRAP_TOKEN"  # not read: set without PDKV_TOKEN, it is an error naming PDKV_TOKEN

MAX_AGE_S = 30.0  # a frame whose clock is further than this from the receiver's is stale (or from the future)
NONCE_CAPACITY = 200_000  # nonces remembered at most; past it the oldest go and the floor rises (see NonceCache)
NONCE_BYTES = 16
TAG_BYTES = 32
TRAILER = struct.Struct(f">{NONCE_BYTES}sQ{TAG_BYTES}s")  # nonce, unix nanoseconds, tag
LOG_EVERY_S = 60.0  # a refusal is logged at most once a minute per peer


def token_from_env(env: dict[str, str] | None = None) -> str | None:
    """The deployment key from PDKV_TOKEN; None when it is unset or empty. ConfigError when PDKV_BOOTSTRAP_TOKEN
    is set and PDKV_TOKEN is not: pdkv reads the key from PDKV_TOKEN only."""
    env = os.environ if env is None else env
    token = env.get(TOKEN_ENV) or None
    if token is None and env.get(RETIRED_TOKEN_ENV):
        raise ConfigError(f"{RETIRED_TOKEN_ENV} is set and {TOKEN_ENV} is not: pdkv reads the deployment key from {TOKEN_ENV} only",
                          hint=f"export {TOKEN_ENV}=\"${RETIRED_TOKEN_ENV}\"; unset {RETIRED_TOKEN_ENV}")
    return token


def bearer_ok(header: str | None, tokens: list[str] | tuple[str, ...] | str) -> bool:
    """Whether an Authorization header carries one of `tokens` as a bearer token (constant time per token)."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = value.strip().encode()
    wanted = [tokens] if isinstance(tokens, str) else tokens
    ok = False
    for t in wanted:
        ok |= hmac.compare_digest(given, t.encode())
    return ok


# --- per-transfer binding -----------------------------------------------------


def new_binding() -> tuple[str, str]:
    """(secret for D, commitment for P): 128 random bits and their SHA-256, both hex."""
    secret = secrets.token_bytes(16)
    return secret.hex(), hashlib.sha256(secret).hexdigest()


def binding_matches(secret_hex: str, commitment_hex: str) -> bool:
    """Whether D's `secret_hex` is the one P's `commitment_hex` commits to; False for anything malformed."""
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        return False
    return hmac.compare_digest(hashlib.sha256(secret).hexdigest(), commitment_hex)


# --- sealed frames --------------------------------------------------------------


class NonceCache:
    """Nonces seen within the age bound, at most `capacity` of them.

    A nonce leaves the cache when its frame could no longer pass the age
    check anyway, or when the cache is full; in the second case `floor`
    rises to that frame's clock, and every frame at or below the floor is
    refused, so a replay is never accepted whichever way its nonce left.
    Guarded by its own lock.
    """

    def __init__(self, capacity: int = NONCE_CAPACITY, max_age_s: float = MAX_AGE_S) -> None:
        self.capacity = capacity
        self.max_age_ns = int(max_age_s * 1e9)
        self.floor_ns = 0
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> sender clock, in arrival order
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: bytes, ts_ns: int, now_ns: int) -> bool:
        """Record `nonce`; False if it was seen, or its clock is at or below the floor."""
        with self._lock:
            seen = self._seen
            while seen:
                first, first_ts = next(iter(seen.items()))
                if first_ts + self.max_age_ns >= now_ns:
                    break
                del seen[first]
            if ts_ns <= self.floor_ns or nonce in seen:
                return False
            seen[nonce] = ts_ns
            while len(seen) > self.capacity:
                _, dropped_ts = seen.popitem(last=False)
                self.floor_ns = max(self.floor_ns, dropped_ts)
            return True


def derive_key(token: str, use: bytes) -> bytes:
    """A key for one use (b"side-channel/v1", b"socket/v1") derived from the deployment key: one use's key says nothing of another's."""
    return hmac.new(token.encode(), b"pdkv/" + use, hashlib.sha256).digest()


class FrameSealer:
    """Seals and opens side-channel frames with a key derived from the deployment key.

    `seal(body, direction)` -> body + trailer; `open(frame, direction)` ->
    (body, "") or (None, reason), so the hot path raises nothing. Directions
    (b"q": to P, b"r": to D) keep a reply from passing as a request. One
    nonce cache per sealer: give each listener its own.
    """

    def __init__(self, token: str, *, max_age_s: float = MAX_AGE_S, capacity: int = NONCE_CAPACITY) -> None:
        self._key = derive_key(token, b"side-channel/v1")
        self.max_age_ns = int(max_age_s * 1e9)
        self.nonces = NonceCache(capacity, max_age_s)

    def seal(self, body: bytes, direction: bytes) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        ts = time.time_ns()
        head = direction + nonce + ts.to_bytes(8, "big")
        tag = hmac.new(self._key, head + body, hashlib.sha256).digest()
        return body + TRAILER.pack(nonce, ts, tag)

    def open(self, frame: bytes, direction: bytes) -> tuple[bytes | None, str]:
        """(body, "") for an authentic, fresh, first-seen frame; else (None, reason): unauthenticated, stale, replayed."""
        if len(frame) < TRAILER.size:
            return None, "unauthenticated"
        cut = len(frame) - TRAILER.size
        body = frame[:cut]
        nonce, ts, tag = TRAILER.unpack_from(frame, cut)
        head = direction + nonce + ts.to_bytes(8, "big")
        if not hmac.compare_digest(hmac.new(self._key, head + bytes(body), hashlib.sha256).digest(), tag):
            return None, "unauthenticated"
        now = time.time_ns()
        if abs(now - ts) > self.max_age_ns:
            return None, "stale"
        if not self.nonces.admit(nonce, ts, now):
            return None, "replayed"
        return bytes(body), ""


class RefusalLog:
    """Logs a refused frame at most once per LOG_EVERY_S per peer, and counts every one by reason."""

    MAX_PEERS = 4096

    def __init__(self, where: str, note: str = "the deployment key is set") -> None:
        self.where = where
        self.note = note
        self.counts: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def refused(self, peer: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1
            last = self._last.get(peer)
            if last is not None and now - last < LOG_EVERY_S:
                return
            if len(self._last) >= self.MAX_PEERS:
                self._last.clear()
            self._last[peer] = now
        log.warning("%s: dropped a frame from %s: %s (%s; logged once a minute per peer)",
                    self.where, peer or "an unknown peer", reason, self.note)


def sealer_from_env() -> FrameSealer | None:
    token = token_from_env()
    return FrameSealer(token) if token else None

"""Following each engine's KV events over ZMQ into the proxy's KvIndex (I/O: one thread, all engines).

Per engine: a SUB socket on its publisher (`tcp://HOST:PORT`, vLLM's
`--kv-events-config endpoint`), a DEALER on its replay socket (vLLM's
`replay_endpoint`, a ROUTER answering `start seq` with every buffered batch
from there, then an end marker), and a socket monitor on the SUB.

- Start (a proxy restart) and every (re)connection of the SUB (an engine
  restart: a new stream, numbered from 0 again): the engine's reported view is
  reset and replayed from sequence 0, so nothing of an old stream stays.
  A batch published between the connection and the publisher learning of the
  subscription (ZMQ's slow joiner) reaches neither the SUB nor, if the replay
  ran first, the replay: one more replay `settle_s` after the connection, from
  the next sequence the index lacks, picks it up.
- A sequence gap (a batch dropped at the high-water mark): replay from the
  first missing one; live batches wait in order until the replay ends.
- Bounds: a replay that has not ended after `replay_timeout_s` is given up
  (and tried again on the next gap); the thread polls every `POLL_S`.
- A stream that is broken (SUB disconnected) or silent (blocks routed there
  `silent_after_s` ago and not reported since) puts the engine in the
  index's approximate view until its events flow again.

`follow(source)` / `unfollow(engine)` change the engines at run time (an
engine learnt from the members registry, whose record names `kv_events` and
`kv_events_replay`), from any thread. The thread owns every socket and the
per-engine stream state; the index has its own lock. `close()` stops the thread within POLL_S + its join bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from pdkv.errors import EventDecodeError
from pdkv.proxy.kv.events import END_SEQ, EventBatch, decode_batch, parse_seq
from pdkv.proxy.kv.index import KvIndex

log = logging.getLogger("pdkv.proxy.kv")
POLL_S = 0.1
SETTLE_S = 0.5  # from a (re)connection to the replay that catches what ZMQ's slow joiner lost


class EventSource(msgspec.Struct, frozen=True):
    """Where one engine (named by its URL, as the proxy routes to it) publishes its KV events."""

    engine: str
    endpoint: str
    replay: str | None = None


class StreamObserver:
    """What the subscriber reports (metrics); every method is called on the subscriber's thread."""

    def batch(self, engine: str, batch: EventBatch, lag_s: float, stored: int, removed: int, orphans: int) -> None: ...
    def replay(self, engine: str, reason: str) -> None: ...
    def mode(self, engine: str, approximate: bool, reason: str) -> None: ...
    def decode_error(self, engine: str) -> None: ...


class _Stream:
    __slots__ = ("connected", "last_seq", "monitor", "pending", "replay", "replay_from", "replay_started", "settle_at", "source", "sub")

    def __init__(self, source: EventSource) -> None:
        self.source = source
        self.sub: Any = None
        self.replay: Any = None
        self.monitor: Any = None
        self.last_seq: int | None = None
        self.replay_from: int | None = None  # a replay in progress from this seq
        self.replay_started = 0.0
        self.pending: list[tuple[int, bytes]] = []  # live batches held while a replay runs
        self.connected = False
        self.settle_at: float | None = None  # when the replay after a (re)connection is due


class KvEventSubscriber:
    def __init__(
        self, index: KvIndex, sources: list[EventSource], *, observer: StreamObserver | None = None, silent_after_s: float = 5.0,
        replay_timeout_s: float = 2.0, settle_s: float = SETTLE_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.sources = sources
        self.observer = observer or StreamObserver()
        self.silent_after_s = silent_after_s
        self.replay_timeout_s = replay_timeout_s
        self.settle_s = settle_s
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()  # follow/unfollow, drained by the thread
        self.batches = 0  # applied so far (read by tests and the self-check)
        self.replays_ended = 0  # replays answered or given up (read by tests)

    def start(self) -> KvEventSubscriber:
        self._thread = threading.Thread(target=self._run, name="pdkv-kv-events", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> KvEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the thread
    def follow(self, source: EventSource) -> None:
        """Follow one more engine (or an engine at new endpoints), from any thread; applied within POLL_S."""
        self._commands.put(("follow", source))

    def unfollow(self, engine: str) -> None:
        """Stop following `engine` and forget its blocks, from any thread."""
        self._commands.put(("unfollow", engine))

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        poller = zmq.Poller()
        streams: dict[str, _Stream] = {}
        owner: dict[Any, tuple[_Stream, str]] = {}

        def open_stream(src: EventSource) -> None:
            st = streams[src.engine] = _Stream(src)
            st.sub = ctx.socket(zmq.SUB)
            st.sub.setsockopt(zmq.LINGER, 0)
            st.sub.setsockopt(zmq.RCVHWM, 100_000)
            st.sub.setsockopt(zmq.SUBSCRIBE, b"")
            st.monitor = st.sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            st.sub.connect(src.endpoint)
            owner[st.sub], owner[st.monitor] = (st, "live"), (st, "monitor")
            if src.replay:
                st.replay = ctx.socket(zmq.DEALER)
                st.replay.setsockopt(zmq.LINGER, 0)
                st.replay.connect(src.replay)
                owner[st.replay] = (st, "replay")
            for sock in (st.sub, st.monitor, st.replay):
                if sock is not None:
                    poller.register(sock, zmq.POLLIN)

        def close_stream(engine: str) -> None:
            st = streams.pop(engine, None)
            if st is None:
                return
            for sock in (st.monitor, st.replay, st.sub):
                if sock is not None:
                    poller.unregister(sock)
                    owner.pop(sock, None)
                    sock.close(linger=0)

        try:
            for src in self.sources:
                open_stream(src)
            while not self._stop.is_set():
                while not self._commands.empty():
                    verb, arg = self._commands.get_nowait()
                    engine = arg.engine if isinstance(arg, EventSource) else arg
                    if verb == "follow" and engine in streams and streams[engine].source == arg:
                        continue
                    close_stream(engine)
                    self.index.forget(engine)
                    if verb == "follow":
                        open_stream(arg)
                for sock, _ in poller.poll(int(POLL_S * 1000)):
                    if sock not in owner:
                        continue
                    st, kind = owner[sock]
                    try:
                        self._on_socket(st, kind, zmq)
                    except Exception:  # one engine's bad frame must not stop the others
                        log.exception("kv events from %s: unexpected failure", st.source.engine)
                for st in list(streams.values()):
                    self._check(st)
        finally:
            for engine in list(streams):
                close_stream(engine)
            ctx.term()

    def _on_socket(self, st: _Stream, kind: str, zmq: Any) -> None:
        if kind == "monitor":
            from zmq.utils.monitor import recv_monitor_message

            event = recv_monitor_message(st.monitor, zmq.NOBLOCK)["event"]
            if event == zmq.EVENT_CONNECTED:
                st.connected = True
                # A (re)connection is a stream we have not seen from its start: forget and replay it all.
                self.index.reset(st.source.engine)
                st.last_seq, st.pending = None, []
                self._request_replay(st, 0, "connected")
                st.settle_at = self.clock() + self.settle_s
            elif event == zmq.EVENT_DISCONNECTED:
                st.connected = False
                if self.index.mark_approximate(st.source.engine, True):
                    self.observer.mode(st.source.engine, True, "disconnected")
            return
        sock = st.sub if kind == "live" else st.replay
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if kind == "replay":
                frames = frames[1:]  # the ROUTER's empty delimiter
            if len(frames) != 3:
                self.observer.decode_error(st.source.engine)
                continue
            try:
                seq = parse_seq(frames[1])
            except EventDecodeError:
                self.observer.decode_error(st.source.engine)
                continue
            if kind == "replay":
                self._on_replayed(st, seq, frames[2])
            else:
                self._on_live(st, seq, frames[2])

    def _on_live(self, st: _Stream, seq: int, payload: bytes) -> None:
        if st.replay_from is not None:
            st.pending.append((seq, payload))
            return
        last = st.last_seq
        if last is not None and seq <= last:
            # Numbered from the start again without a reconnect we saw: a new stream all the same.
            self.index.reset(st.source.engine)
            st.last_seq = None
            if self._request_replay(st, 0, "restarted"):
                st.pending.append((seq, payload))
                return
        elif last is not None and seq > last + 1:
            if self._request_replay(st, last + 1, "gap"):
                st.pending.append((seq, payload))
                return
        self._apply(st, seq, payload)

    def _on_replayed(self, st: _Stream, seq: int, payload: bytes) -> None:
        if seq == END_SEQ:
            self._end_replay(st)
            return
        if st.last_seq is None or seq > st.last_seq:
            self._apply(st, seq, payload)

    def _end_replay(self, st: _Stream, answered: bool = True) -> None:
        st.replay_from = None
        pending, st.pending = sorted(st.pending), []
        for seq, payload in pending:
            if st.last_seq is None or seq > st.last_seq:
                self._apply(st, seq, payload)
        if answered and self.index.mark_approximate(st.source.engine, False):
            self.observer.mode(st.source.engine, False, "replayed")
        self.replays_ended += 1

    def _request_replay(self, st: _Stream, start: int, reason: str) -> bool:
        if st.replay is None:
            return False
        st.replay.send_multipart([b"", start.to_bytes(8, "big")])
        st.replay_from, st.replay_started = start, self.clock()
        self.observer.replay(st.source.engine, reason)
        return True

    def _apply(self, st: _Stream, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            log.warning("kv events from %s: batch %d unreadable: %s", st.source.engine, seq, exc.message)
            self.observer.decode_error(st.source.engine)
            st.last_seq = seq
            return
        st.last_seq = seq
        result = self.index.apply(st.source.engine, batch.events, self.clock())
        self.batches += 1
        if result.orphans:
            log.debug("kv events from %s: %d blocks with an unknown parent", st.source.engine, result.orphans)
        self.observer.batch(st.source.engine, batch, max(0.0, time.time() - batch.ts), result.stored, result.removed, result.orphans)
        if self.index.mark_approximate(st.source.engine, False):
            self.observer.mode(st.source.engine, False, "events")

    def _check(self, st: _Stream) -> None:
        now = self.clock()
        if st.settle_at is not None and now >= st.settle_at and st.replay_from is None:
            st.settle_at = None
            self._request_replay(st, 0 if st.last_seq is None else st.last_seq + 1, "settle")
        if st.replay_from is not None and now - st.replay_started > self.replay_timeout_s:
            log.warning("kv events from %s: replay from %d not answered in %.1f s; following the live stream",
                        st.source.engine, st.replay_from, self.replay_timeout_s)
            self.observer.replay(st.source.engine, "timeout")
            self._end_replay(st, answered=False)
        since = self.index.silent_since(st.source.engine)
        if since is not None and now - since > self.silent_after_s and self.index.mark_approximate(st.source.engine, True):
            log.warning("kv events from %s: no event %.0f s after routing new blocks there; routing it by the proxy's own view",
                        st.source.engine, now - since)
            self.observer.mode(st.source.engine, True, "silent")

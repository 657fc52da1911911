"""P's worker side (steps 1-4, 14, 22, 27-31): hold finished requests' blocks and push them to D.

`KVSender` owns the side-channel server, the SendTable and the writes. The model runner's thread calls `apply_step`
(scheduler metadata), `prompt_done`, `take_finished` (step 32), `wait_finished`, and writing layer by layer (`layers`)
`prompt_starts` and `layer_ready`; everything else runs on the sender's loop thread. Writes run on a small thread pool
per D (pdkv.connector.writers, layer_writes), so a slow D never stalls the listener nor the transfers to another D.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from pdkv.auth import FrameSealer
from pdkv.connector.side_channel import EventLoopThread, SideChannelServer
from pdkv.connector.checks import announced_share, check_announce, check_pull
from pdkv.connector.layer_writes import LayerBoard, LayerCursor
from pdkv.connector.send_table import Free, Reply, SendLimits, SendTable, StartSend, pull_key
from pdkv.connector.timing import TraceLog
from pdkv.connector.writers import WriterPools, write_layers, write_transfer
from pdkv.errors import PdkvError
from pdkv.wire import Announce, ErrorReply, PullReply, PullRequest, PullStatus, Region, Release, StatsQuery, StatsReply, TraceReport
from pdkv.transport import Transport
from pdkv.tp_heads import HeadShare, pullers

log = logging.getLogger("pdkv.connector")

MAX_ANNOUNCED = 1024  # D sessions whose regions P remembers; the least recently announced is forgotten first


class _Parked:
    """A pull waiting on P: who asked, what, the regions D announced for its session when it asked, and the
    heads of each block this P rank writes there (None: whole blocks); `key` names it in the table (pull_key)."""

    __slots__ = ("announced", "heads", "identity", "key", "request")

    def __init__(self, identity: bytes, request: PullRequest, announced: Announce, heads: HeadShare | None, key: str) -> None:
        self.identity = identity
        self.request = request
        self.announced = announced
        self.heads = heads
        self.key = key


class KVSender:
    """P's half of the transfer. A context manager; `close()` stops the listener and the loop."""

    def __init__(
        self,
        transport: Transport,
        regions: list[Region],
        *,
        host: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        kv_heads: int = 0,
        engine_id: str = "",
        limits: SendLimits | None = None,
        heartbeat_s: float = 1.0,
        trace: TraceLog | None = None,
        port: int = 0,
        wait_write_s: float = 0.0,
        sealer: FrameSealer | None = None,
        layers: LayerBoard | None = None,
    ) -> None:
        """`sealer`: the deployment key's frame sealer (pdkv.auth.sealer_from_env()); None: frames unsealed.
        `kv_heads`: the model's KV heads, all ranks together (0: unknown, and only a D of this TP size is served).
        `layers`: what writes layer by layer go through (None: one write after the forward completing a prompt)."""
        self._closed = False  # set under _table_lock: no send starts once it is
        self.transport = transport
        self.regions = list(regions)
        self.tp_rank, self.tp_size, self.engine_id, self.kv_heads = tp_rank, tp_size, engine_id, kv_heads
        self.table = SendTable(limits)
        # The table is the loop thread's, except for `prompt_done` on the model runner's thread.
        self._table_lock = threading.RLock()
        self.wait_write_s = wait_write_s
        self.heartbeat_s = heartbeat_s
        self._last_beat = 0.0  # the ticker's: when it last sent parked pulls a heartbeat
        self.trace = trace or TraceLog("prefill", engine_id=engine_id, tp_rank=tp_rank)
        self._finished: set[str] = set()
        self._lock = threading.Lock()
        self._news = threading.Event()  # set when blocks may be freed (`_finished` grew), cleared when they are taken
        self._writers = WriterPools()
        self._board = layers if layers is not None else LayerBoard()
        self._forward_sends: list[concurrent.futures.Future] = []  # sends of the open forward; guarded by _table_lock
        self._fences: dict[str, Any] = {}  # transfer_id -> the GPU event its writes wait for; guarded by _table_lock
        # (D session, D TP rank) -> its latest accepted announcement, or why the latest was refused; ranks of one
        # process (one cma session) announce apart; owned by the loop thread
        self._announced: OrderedDict[tuple[str, int], Announce | str] = OrderedDict()
        self._loop = EventLoopThread("pdkv-sender")
        self.server = SideChannelServer(self._loop, host, self._handle, port=port, sealer=sealer, on_refused=self.trace.auth_refused)
        self._ticker = self._loop.submit(self._tick_forever())

    @property
    def address(self) -> str:
        return self.server.address

    # --- called from the model runner's thread -------------------------------

    def apply_step(
        self,
        registered: dict[str, str] | None = None,
        ready: dict[str, tuple[str, list[int]]] | None = None,
        cancelled: dict[str, str] | None = None,
        ready_at: dict[str, float] | None = None,
        scheduled_at: float = 0.0,
        fanout: dict[str, int] | None = None,
        bindings: dict[str, str] | None = None,
    ) -> None:
        """Scheduler news: {p_req_id: transfer_id} scheduled (at `scheduled_at`), {p_req_id: (transfer_id, blocks)}
        finished (at `ready_at[p_req_id]`, when the scheduler saw it), {transfer_id: reason} ended without KV;
        `fanout`: {transfer_id: how many D requests pull it}, where more than one; `bindings`: {transfer_id: commitment
        to the binding secret of the D that may pull it}. Both are recorded before this returns: no pull is served
        unchecked, and a prompt computed before its registration reaches the table waits for each choice's pull."""
        if bindings or fanout:
            with self._table_lock:
                for tid, commitment in (bindings or {}).items():
                    self.table.bind(tid, commitment)
                for tid, pulls in (fanout or {}).items():
                    self.table.expect(tid, pulls)
        if registered or ready or cancelled:
            now = time.time()
            self._loop.call_soon(
                self._apply, dict(registered or {}), dict(ready or {}), dict(cancelled or {}), now, dict(ready_at or {}), scheduled_at,
                dict(fanout or {}),
            )

    def prompt_done(self, items: dict[str, tuple[str, list[int]]], fence: Any = None) -> None:
        """{p_req_id: (transfer_id, blocks)} whose prompt the forward just completed; `fence`, if set,
        is an event the KV writes wait for (the forward may still run on the GPU).

        Sends whose pull is already here start now (or did at prompt_starts), on the transfer threads. With
        `wait_write_s` (KV in host memory: the write and this thread share the cores) this thread then steps aside
        for at most that long while they run, and P samples its token after."""
        now = time.time()
        with self._table_lock:
            if self._closed:
                return  # shutting down: the scheduler frees what it holds
            for p_req_id, (tid, _) in items.items():
                self.trace.event(tid, "p_forward_done", now, p_req_id=p_req_id)
            if self._board.forward_done(fence):
                sends, self._forward_sends = self._forward_sends, []
            else:
                sends = self._blocks_computed(items, now, fence)
        if sends and self.wait_write_s > 0:
            concurrent.futures.wait(sends, timeout=self.wait_write_s)

    def prompt_starts(self, items: dict[str, tuple[str, list[int]]], stale_fence: Any = None) -> None:
        """Writing layer by layer: the forward completing these prompts begins, and ends with `prompt_done`; each
        layer may be sent once `layer_ready` says so. `stale_fence`: where an unended forward before it is done."""
        with self._table_lock:
            if self._closed or not self._board.on:
                return
            self._board.open((tid for tid, _ in items.values()), stale_fence)
            self._forward_sends = self._blocks_computed(items, time.time(), None)

    def layer_ready(self, layer: int, fence: Any = None) -> None:
        """Layer `layer` of the open forward has its KV in the cache; its writes wait for `fence` first, if set."""
        self._board.layer_ready(layer, fence)

    def _blocks_computed(self, items: dict[str, tuple[str, list[int]]], now: float, fence: Any) -> list[concurrent.futures.Future]:
        """Tell the table these prompts' KV may be sent; start the sends whose pull is here (under _table_lock)."""
        sends: list[concurrent.futures.Future[None]] = []
        rest: list[Any] = []
        for p_req_id, (tid, blocks) in items.items():
            if fence is not None:
                self._fences[tid] = fence
            for a in self.table.prompt_done(tid, p_req_id, blocks, now):
                if isinstance(a, StartSend):
                    sends.append(self._start_send(a))
                else:
                    rest.append(a)
        if rest:
            self._loop.call_soon(self._run, rest)
        return sends

    def take_finished(self) -> set[str]:
        """P request ids whose blocks may be freed now (sent, failed, expired or released)."""
        with self._lock:
            out, self._finished = self._finished, set()
            self._news.clear()
        return out

    def wait_finished(self, timeout: float) -> bool:
        """Wait up to `timeout` s for blocks that may be freed; at once when some may already be, or when none are
        held for D (nothing could come). True when the wait ran (the caller gave its core back)."""
        if timeout <= 0 or self._news.is_set():
            return False
        with self._table_lock:
            if self._closed or not self.table.holding():
                return False
        self._news.wait(timeout)
        return True

    # --- loop thread ---------------------------------------------------------

    def _apply(
        self, registered: dict, ready: dict, cancelled: dict, now: float, ready_at: dict | None = None, scheduled_at: float = 0.0,
        fanout: dict[str, int] | None = None,
    ) -> None:
        for p_req_id, tid in registered.items():
            self.trace.event(tid, "registered", scheduled_at or now, p_req_id=p_req_id)
            with self._table_lock:
                actions = self.table.registered(tid, p_req_id, now, (fanout or {}).get(tid, 1))
            self._run(actions)
        for p_req_id, (tid, blocks) in ready.items():
            if ready_at and p_req_id in ready_at:
                self.trace.event(tid, "p_computed", ready_at[p_req_id], p_req_id=p_req_id)
            self.trace.event(tid, "p_finished", now, p_req_id=p_req_id)
            with self._table_lock:
                actions = self.table.ready(tid, p_req_id, blocks, now)
            self._run(actions)
        for tid, reason in cancelled.items():
            self._board.drop(tid)
            self.trace.event(tid, "p_finished", now)
            self.trace.finish(tid, "cancelled", reason)
            with self._table_lock:
                self._fences.pop(tid, None)  # a cancelled transfer may have no Free to come
                actions = self.table.cancelled(tid, reason, now)
            self._run(actions)

    def _run(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, StartSend):
                self._start_send(a)
            elif isinstance(a, Reply):
                if a.pull is not None:
                    req = a.pull.request
                    log.warning("pdkv: pull %s (D request %s) refused: %s", a.transfer_id, req.d_req_id, a.error)
                    refused = PullReply(transfer_id=a.transfer_id, d_req_id=req.d_req_id, status=PullStatus.ERROR, error=a.error)
                    self._reply(a.pull.identity, refused)
                    if a.error.startswith("prefill side never saw"):
                        self.trace.finish(a.transfer_id, "unknown", a.error)
            elif isinstance(a, Free):
                with self._table_lock:
                    self._fences.pop(a.transfer_id, None)
                self._board.drop(a.transfer_id)
                self.trace.event(a.transfer_id, "freed")
                if a.outcome in ("expired", "released", "duplicate"):
                    self.trace.finish(a.transfer_id, a.outcome)
                    log.warning("pdkv: freed blocks of %s unsent (%s)", a.transfer_id, a.outcome)
                with self._lock:
                    self._finished.add(a.p_req_id)
                    self._news.set()

    def _reply(self, identity: bytes, reply: Any) -> None:
        asyncio.get_running_loop().create_task(self.server.send(identity, reply))

    async def _handle(self, identity: bytes, msg: Any) -> None:
        now = time.time()
        if isinstance(msg, Announce):
            why = check_announce(msg, self.regions, self.tp_rank, self.tp_size, self.kv_heads)
            self._announced[(msg.session, msg.tp_rank)] = msg if why is None else f"its announced regions were refused: {why}"
            self._announced.move_to_end((msg.session, msg.tp_rank))
            while len(self._announced) > MAX_ANNOUNCED:
                self._announced.popitem(last=False)
            if why is not None:
                self.trace.malformed()
                log.warning("pdkv: refused the KV regions announced by decode at %s: %s", msg.session, why)
                await self.server.send(identity, ErrorReply(error=f"announced regions refused: {why}"))
        elif isinstance(msg, PullRequest):
            self.trace.event(msg.transfer_id, "pull_received", now, d_req_id=msg.d_req_id)
            announced = self._announced.get((msg.session, msg.tp_rank))
            if announced is not None:
                self._announced.move_to_end((msg.session, msg.tp_rank))  # in use: the last to be forgotten
            if isinstance(announced, str):
                why: str | None = f"decode at {msg.session}: {announced}"
            else:
                why = check_pull(msg, announced)
            if why is not None:
                self.trace.malformed()
                log.warning("pdkv: refused pull %s from D request %s: %s", msg.transfer_id, msg.d_req_id, why)
                await self.server.send(
                    identity, PullReply(transfer_id=msg.transfer_id, d_req_id=msg.d_req_id, status=PullStatus.ERROR, error=why)
                )
                return
            assert isinstance(announced, Announce)
            heads = announced_share(announced, self.tp_rank, self.tp_size, self.kv_heads)  # accepted: it does not raise
            ranks = pullers(self.kv_heads, self.tp_size, announced.tp_size, self.tp_rank) if heads is not None else 1
            key = pull_key(msg.d_req_id, msg.tp_rank, msg.tp_size, self.tp_size)
            with self._table_lock:
                actions = self.table.pull(msg.transfer_id, _Parked(identity, msg, announced, heads, key), now, ranks=ranks)
            self._run(actions)
        elif isinstance(msg, Release):
            key = pull_key(msg.d_req_id, msg.tp_rank, msg.tp_size, self.tp_size)
            with self._table_lock:
                actions = self.table.released(msg.transfer_id, now, key, proof=msg)
            self._run(actions)
        elif isinstance(msg, TraceReport):
            self.trace.merge(msg.transfer_id, msg.events, msg.first_step_tokens)
        elif isinstance(msg, StatsQuery):
            await self.server.send(
                identity,
                StatsReply(
                    engine_id=self.engine_id,
                    tp_rank=self.tp_rank,
                    traces=self.trace.query(msg.since, msg.limit),
                    metrics=self.trace.render_metrics(),
                ),
            )

    def _start_send(self, a: StartSend) -> concurrent.futures.Future[None]:
        """Run the write on a transfer thread (from any thread); the loop thread tells D.
        The returned future is done once D has been told (or the sender closed)."""
        told: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._table_lock:
            if self._closed:  # the pool is shut down; the scheduler frees what it holds
                told.set_result(None)
                return told
            fence = self._fences.get(a.transfer_id)  # every pull of the transfer waits for it; dropped at Free
            cursor = self._board.cursor(a.transfer_id)
            fut = self._writers.submit(a.pull.request.session, self._transfer, a, fence, cursor)
        fut.add_done_callback(lambda f: self._loop.call_soon(self._concluded, a, f, told))
        return told

    def _concluded(
        self, a: StartSend, fut: concurrent.futures.Future[tuple[str | None, int, int]], told: concurrent.futures.Future[None]
    ) -> None:
        if fut.cancelled():  # the sender is closing
            told.set_result(None)
            return
        task = asyncio.get_running_loop().create_task(self._conclude(a, *fut.result()))
        task.add_done_callback(lambda _t: told.set_result(None))

    def _transfer(self, a: StartSend, fence: Any, cursor: LayerCursor | None = None) -> tuple[str | None, int, int]:
        """Write one transfer (on a transfer thread): (error, bytes, descriptors). `fence`: what the write waits
        for first (write_transfer); `cursor`: write it layer by layer instead, as its forward gives them."""
        event = functools.partial(self.trace.event, a.transfer_id)
        try:
            nbytes, ndesc = (write_layers(self.transport, self.regions, a, cursor, event) if cursor is not None
                             else write_transfer(self.transport, self.regions, a, fence, event))
        except PdkvError as exc:
            return str(exc), 0, 0
        except Exception as exc:  # noqa: BLE001 - any failure must reach D and free the blocks
            return f"{type(exc).__name__}: {exc}", 0, 0
        return None, nbytes, ndesc

    async def _conclude(self, a: StartSend, error: str | None, nbytes: int, ndesc: int) -> None:
        """Tell D how the write went, then let the table free the blocks."""
        req: PullRequest = a.pull.request
        if error is None:
            reply = PullReply(transfer_id=a.transfer_id, d_req_id=req.d_req_id, status=PullStatus.DONE, bytes=nbytes, descriptors=ndesc)
        else:
            log.warning("pdkv: transfer %s to %s failed: %s", a.transfer_id, req.session, error)
            reply = PullReply(transfer_id=a.transfer_id, d_req_id=req.d_req_id, status=PullStatus.ERROR, error=f"transfer failed: {error}")
        await self.server.send(a.pull.identity, reply)
        self.trace.event(a.transfer_id, "reply_sent")
        d_rank = req.tp_rank if req.tp_size > self.tp_size else None  # several D ranks take heads from this rank
        self.trace.finish(a.transfer_id, "sent" if error is None else "failed", error or "", nbytes, ndesc, d_rank)
        with self._table_lock:
            actions = self.table.send_finished(a.transfer_id, error, time.time(), a.pull.key)
        self._run(actions)

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.heartbeat_s, 0.25))
            now = time.time()
            try:
                with self._table_lock:
                    actions = self.table.tick(now)
                    parked_pulls = self.table.parked_pulls()
                self._run(actions)
                if now - self._last_beat >= self.heartbeat_s:
                    self._last_beat = now
                    for tid, parked, deadline in parked_pulls:
                        bound = max(0.0, deadline - now) if deadline is not None else 0.0
                        await self.server.send(
                            parked.identity,
                            PullReply(transfer_id=tid, d_req_id=parked.request.d_req_id, status=PullStatus.PENDING, wait_bound_s=bound),
                        )
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the ticker must outlive one bad entry
                log.exception("pdkv: sender tick failed")

    def close(self) -> None:
        """Stop listening and release the loop; idempotent."""
        with self._table_lock:
            if self._closed:
                return
            self._closed = True
        self._news.set()  # a model runner waiting in wait_finished goes on
        self._board.close()  # writes waiting for a layer fail now
        self._ticker.cancel()
        self.server.close()
        self._loop.stop()
        self._writers.shutdown()
        self.trace.close()

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

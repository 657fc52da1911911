"""D's worker side (steps 5, 19-21, 34-35): ask P to write a request's KV into D's blocks.

`KVReceiver.apply_step` (model runner's thread) starts pulls and aborts;
`take_results` (step 35) returns the finished and the failed ones. The
loop thread resolves P's side channel through the bootstrap server, keeps
one DEALER per P worker, and fails any pull whose P stays silent longer
than the liveness bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pdkv.auth import FrameSealer
from pdkv.connector.side_channel import EventLoopThread, SideChannelPeer
from pdkv.connector.pulls import PullOutcome, PullSpec, PullTracker, write_key
from pdkv.connector.timing import TraceLog
from pdkv.errors import PdkvError, TransferError
from pdkv.wire import Announce, ErrorReply, IpcExport, PullReply, PullRequest, PullStatus, Region, Release, TraceReport
from pdkv.tp_heads import head_shares, pullers
from pdkv.transport import Transport, block_spans

log = logging.getLogger("pdkv.connector")


@dataclass
class Results:
    finished: set[str] = field(default_factory=set)  # every concluded pull, failed ones included
    failed: dict[str, str] = field(default_factory=dict)  # d_req_id -> why
    failed_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # d_req_id -> its blocks to recompute
    transfer_ids: dict[str, str] = field(default_factory=dict)  # d_req_id -> transfer_id


class KVReceiver:
    """D's half of the transfer. A context manager."""

    def __init__(
        self,
        session: str,
        regions: list[Region],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        kv_heads: int = 0,
        liveness_s: float = 10.0,
        trace: TraceLog | None = None,
        bootstrap_timeout: float = 2.0,
        ipc: IpcExport | None = None,
        sealer: FrameSealer | None = None,
        transport: Transport | None = None,
    ) -> None:
        """`sealer`: the deployment key's frame sealer (pdkv.auth.sealer_from_env()); None: frames unsealed.
        `transport`: D's, told which blocks each pull lets P write (Transport.expect) and when it concluded.
        `kv_heads`: the model's KV heads, all ranks together (0: unknown; then only a P of this TP size serves it)."""
        self.session = session
        self.sealer = sealer
        self.transport = transport
        self.regions = list(regions)
        self.tp_rank, self.tp_size, self.kv_heads = tp_rank, tp_size, kv_heads
        # Sent on each connection to a P before its first pull: P writes only inside these regions.
        self.announcement = Announce(session=session, tp_rank=tp_rank, tp_size=tp_size, regions=self.regions, ipc=ipc,
                                     kv_heads=kv_heads)
        self._announced_to: set[str] = set()  # P addresses told since the connection was last lost; loop thread
        self.tracker = PullTracker(liveness_s)
        self.trace = trace or TraceLog("decode", tp_rank=tp_rank)
        self.bootstrap_timeout = bootstrap_timeout
        self.ipc = ipc
        self._results = Results()
        self._lock = threading.Lock()
        self._news = threading.Event()  # set when a pull concludes, cleared when results are taken
        self._loop = EventLoopThread("pdkv-receiver")
        self._peers: dict[str, SideChannelPeer] = {}
        # (bootstrap, P engine) -> (side channels of the P ranks this D rank pulls, those of P ranks no D rank pulls)
        self._addr_cache: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
        # d_req_id -> the P ranks' side channels it pulls from (several where P's TP is larger than D's)
        self._peer_of: dict[str, list[str]] = {}
        self._binding: dict[str, str] = {}  # d_req_id -> its transfer's binding secret, while its pull is live
        self._done_tid: dict[str, str] = {}  # d_req_id -> transfer_id, KV arrived, first token pending
        self._ctx: Any = None
        self._closed = False
        self._ticker = self._loop.submit(self._tick_forever())

    # --- model runner's thread -----------------------------------------------

    def apply_step(
        self,
        pulls: list[PullSpec] | None = None,
        aborts: list[str] | None = None,
        first_tokens: dict[str, tuple[float, int]] | None = None,
        releases: list[PullSpec] | None = None,
    ) -> None:
        if pulls or aborts or first_tokens or releases:
            now = time.time()
            self._loop.call_soon(self._apply, list(pulls or ()), list(aborts or ()), dict(first_tokens or {}), now, list(releases or ()))

    def wait_results(self, timeout: float) -> None:
        """Wait up to `timeout` s for a pull in flight to conclude; return at once when none is in flight."""
        if timeout > 0 and self.tracker.entries and not self._news.is_set():
            self._news.wait(timeout)

    def take_results(self) -> Results:
        with self._lock:
            out, self._results = self._results, Results()
            self._news.clear()
        for tid in out.transfer_ids.values():
            self.trace.event(tid, "reported")
        return out

    # --- loop thread -----------------------------------------------------------

    def _apply(
        self, pulls: list[PullSpec], aborts: list[str], first_tokens: dict[str, tuple[float, int]], now: float,
        releases: list[PullSpec] | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        for spec in releases or ():
            loop.create_task(self._release(spec))
        for spec in pulls:
            self.trace.event(spec.transfer_id, "pull_scheduled", now, d_req_id=spec.d_req_id)
            self.tracker.started(spec.d_req_id, spec.transfer_id, now, tuple(spec.block_ids))
            if spec.binding:
                self._binding[spec.d_req_id] = spec.binding
            if spec.error is None and self.transport is not None:
                try:
                    self.transport.expect(write_key(spec.transfer_id, spec.d_req_id), block_spans(spec.block_ids, self.regions))
                except TransferError as exc:
                    spec = PullSpec(spec.d_req_id, spec.transfer_id, spec.bootstrap_addr, spec.engine_id, spec.block_ids,
                                    error=f"cannot expect the KV write: {exc}")
            if spec.error is not None:
                self._conclude(self.tracker.finished(spec.d_req_id, spec.error))
                continue
            loop.create_task(self._start(spec))
        for rid in aborts:
            entry = self.tracker.abort(rid)
            addrs = [a for a in self._peer_of.get(rid, ()) if a in self._peers]
            if entry is not None and addrs:
                release = Release(transfer_id=entry.transfer_id, d_req_id=rid, reason="decode request ended",
                                  binding=self._binding.get(rid, ""), tp_rank=self.tp_rank, tp_size=self.tp_size)
                for addr in addrs:
                    loop.create_task(self._peers[addr].send(release))
            elif entry is not None:
                self._conclude(self.tracker.finished(rid, "aborted by the decode side"))
        for rid, (at, ntok) in first_tokens.items():
            tid = self._done_tid.pop(rid, None)
            if tid is None:
                continue
            self.trace.event(tid, "first_token_scheduled", at, first_step_tokens=ntok)
            log.info("pdkv: request %s (transfer %s) computes %d token(s) in its first step after the KV arrived", rid, tid, ntok)
            t = self.trace.get(tid)
            for addr in self._peer_of.pop(rid, ()):
                if t is not None and addr in self._peers:
                    report = TraceReport(transfer_id=tid, events=t.events, first_step_tokens=ntok)
                    loop.create_task(self._peers[addr].send(report))
            self.trace.finish(tid, t.status if t else "sent")

    async def _resolve(self, bootstrap: str, engine_id: str) -> tuple[list[str], list[str]]:
        """The side channels of the P ranks this D rank takes its heads from: P's rank of the same number for equal
        TP, else those pdkv.transport.descriptors.head_shares names (one where D's TP is larger, several where P's is);
        and, for D rank 0, those of the P ranks no D rank takes heads from (heads replicated on P), which it releases."""
        key = (bootstrap, engine_id)
        if key in self._addr_cache:
            return self._addr_cache[key]
        from pdkv.bootstrap import AsyncBootstrapClient

        async with AsyncBootstrapClient(bootstrap, timeout=self.bootstrap_timeout, retries=2) as bs:
            engines = await bs.query()
        for entry in engines.values():
            if entry.engine_id != engine_id:
                continue
            ranks = entry.worker_addr
            p_tp = len(ranks)
            if p_tp == self.tp_size:
                sources = [self.tp_rank]
            elif not self.kv_heads:
                raise PdkvError(f"prefill engine {engine_id} has TP {p_tp}, this decode engine TP {self.tp_size}: unequal TP "
                                "needs the model's KV head count, which this decode worker was not given")
            else:
                try:
                    sources = sorted(head_shares(self.kv_heads, p_tp, self.tp_size, self.tp_rank))
                except TransferError as exc:
                    raise PdkvError(f"prefill engine {engine_id} has TP {p_tp}, this decode engine TP {self.tp_size}: {exc}") from None
            unequal_rank0 = p_tp != self.tp_size and self.tp_rank == 0
            idle = [r for r in range(p_tp) if unequal_rank0 and not pullers(self.kv_heads, p_tp, self.tp_size, r)]
            addrs: tuple[list[str], list[str]] = ([], [])
            for group, wanted in zip(addrs, (sources, idle), strict=True):
                for rank in wanted:
                    addr = ranks.get(str(rank), {}).get("0")
                    if addr is None:
                        raise PdkvError(f"prefill engine {engine_id} has no side channel for TP rank {rank}")
                    group.append(addr)
            self._addr_cache[key] = addrs
            return addrs
        raise PdkvError(f"prefill engine {engine_id} is not registered at {bootstrap}")

    async def _release(self, spec: PullSpec) -> None:
        """Tell P that D will never pull `spec`'s KV, so that P frees its blocks now rather than at expiry."""
        try:
            pulled, idle = await self._resolve(spec.bootstrap_addr, spec.engine_id)
            for addr in pulled + idle:
                await self._peer(addr).send(self._release_of(spec, "decode will not pull"))
        except Exception as exc:  # noqa: BLE001 - P's expiry frees the blocks anyway
            log.warning("pdkv: could not release transfer %s at the prefill side: %s", spec.transfer_id, exc)

    def _peer(self, addr: str) -> SideChannelPeer:
        peer = self._peers.get(addr)
        if peer is None:
            import zmq.asyncio

            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            peer = self._peers[addr] = SideChannelPeer(
                self._ctx, addr, lambda msg: self._on_reply(msg, addr), self._on_lost, sealer=self.sealer,
                on_refused=self.trace.auth_refused, heartbeat_timeout_ms=int(self.tracker.liveness_s * 1000),
            )
        return peer

    async def _start(self, spec: PullSpec) -> None:
        try:
            addrs, idle = await self._resolve(spec.bootstrap_addr, spec.engine_id)
        except PdkvError as exc:
            self._conclude(self.tracker.finished(spec.d_req_id, f"cannot reach the prefill engine: {exc}"))
            return
        except Exception as exc:  # noqa: BLE001
            self._conclude(self.tracker.finished(spec.d_req_id, f"cannot reach the prefill engine: {type(exc).__name__}: {exc}"))
            return
        entry = self.tracker.entries.get(spec.d_req_id)
        if entry is None:
            # Concluded while P's side channel was being found (out of time, or aborted): P never heard of this
            # pull, and would hold its blocks for this rank until they expire. Tell it this rank will not pull.
            for addr in addrs + idle:
                await self._peer(addr).send(self._release_of(spec, "decode stopped waiting before it asked"))
            return
        self._peer_of[spec.d_req_id] = addrs
        self.tracker.expect(spec.d_req_id, addrs, time.time())
        peers = [self._peer(addr) for addr in addrs]
        for addr, peer in zip(addrs, peers, strict=True):
            if peer.lost:  # P died or closed its side channel, and has not come back
                since = time.monotonic() - peer.lost_at
                self._conclude(self.tracker.finished(
                    spec.d_req_id, f"the prefill side channel {addr} is gone (connection lost {since:.1f} s ago, not made again since)"))
                return
        if entry.aborted:
            release = self._release_of(spec, "decode request ended")
            for peer in [*peers, *map(self._peer, idle)]:
                await peer.send(release)
            return
        req = PullRequest(
            transfer_id=spec.transfer_id,
            d_req_id=spec.d_req_id,
            session=self.session,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            block_ids=list(spec.block_ids),
            first_block=spec.first_block,
            binding=spec.binding,
        )
        for addr, peer in zip(addrs, peers, strict=True):
            if addr not in self._announced_to:  # one socket, in order: P has the regions before the pull
                self._announced_to.add(addr)
                await peer.send(self.announcement)
        self.trace.event(spec.transfer_id, "pull_sent")
        for peer in peers:
            await peer.send(req)
        for addr in idle:  # P ranks holding only heads other P ranks give: nothing to wait for there
            await self._peer(addr).send(self._release_of(spec, "decode takes no heads from this rank"))

    def _release_of(self, spec: PullSpec, reason: str) -> Release:
        """This rank's word to P that it will not pull `spec`'s KV (P frees the blocks once no rank will)."""
        return Release(transfer_id=spec.transfer_id, d_req_id=spec.d_req_id, reason=reason, binding=spec.binding,
                       tp_rank=self.tp_rank, tp_size=self.tp_size)

    def _on_reply(self, msg: Any, addr: str = "") -> None:
        """A reply from the P rank at `addr`."""
        now = time.time()
        if isinstance(msg, ErrorReply):
            log.warning("pdkv: prefill side refused a message: %s", msg.error)
            return
        if not isinstance(msg, PullReply):
            return
        entry = self.tracker.entries.get(msg.d_req_id)
        if entry is None or entry.transfer_id != msg.transfer_id:
            return  # a late answer to a pull already concluded
        if msg.status == PullStatus.PENDING:
            self.tracker.heard(msg.d_req_id, now)
            return
        if msg.status == PullStatus.ERROR and "announced" in msg.error:
            # P forgot or refused D's regions (restarted, evicted, or told otherwise): announce again next time.
            self._announced_to.difference_update([addr] if addr else self._peer_of.get(msg.d_req_id, ()))
        if msg.status == PullStatus.DONE:
            outcome = self.tracker.part_done(msg.d_req_id, addr, msg.bytes, msg.descriptors)
            if outcome is not None:  # every P rank asked is done
                self.trace.event(msg.transfer_id, "notified", now, bytes=entry.bytes, descriptors=entry.descriptors)
                self._conclude(outcome)
        else:
            self.trace.event(msg.transfer_id, "notified", now)
            self._conclude(self.tracker.finished(msg.d_req_id, msg.error or "prefill side reported an error"))

    def _on_lost(self, addr: str) -> None:
        """The connection to P at `addr` ended: every pull in flight there fails now (P kept no state of it),
        and the next pull there announces D's regions again."""
        self._announced_to.discard(addr)
        lost = [rid for rid, a in self._peer_of.items() if addr in a and rid in self.tracker.entries]
        for rid in lost:
            self._conclude(self.tracker.finished(rid, f"lost the connection to the prefill side channel {addr}"))

    def _conclude(self, outcome: PullOutcome | None) -> None:
        if outcome is None:
            return
        if self.transport is not None:
            self.transport.forget(write_key(outcome.transfer_id, outcome.d_req_id))
        self._binding.pop(outcome.d_req_id, None)
        if outcome.error is None:
            self._done_tid[outcome.d_req_id] = outcome.transfer_id
            self.trace.event(outcome.transfer_id, "concluded", status="sent")
        else:
            log.error("pdkv: KV pull %s for request %s failed: %s", outcome.transfer_id, outcome.d_req_id, outcome.error)
            self.trace.finish(outcome.transfer_id, "failed", outcome.error)
            self._peer_of.pop(outcome.d_req_id, None)
        with self._lock:
            self._results.finished.add(outcome.d_req_id)
            self._results.transfer_ids[outcome.d_req_id] = outcome.transfer_id
            if outcome.error is not None:
                self._results.failed[outcome.d_req_id] = outcome.error
                self._results.failed_blocks[outcome.d_req_id] = outcome.failed_blocks
            self._news.set()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            try:
                for outcome in self.tracker.tick(time.time()):
                    self._conclude(outcome)
            except Exception:  # noqa: BLE001 - the liveness bound must outlive one bad entry
                log.exception("pdkv: receiver tick failed")

    def close(self) -> None:
        async def _close() -> None:
            for p in self._peers.values():
                p.close()
            if self._ctx is not None:
                self._ctx.term()

        if self._closed:
            return
        self._closed = True
        self._ticker.cancel()
        try:
            self._loop.submit(_close()).result(5)
        except Exception:  # noqa: BLE001 - closing
            pass
        self._loop.stop()
        self.trace.close()

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

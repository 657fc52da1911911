"""P and D of pdkv's connector in one process, over real sockets: memory, transports, a bootstrap server, KVSender and
KVReceiver, and bounded waits on what they report.

No vLLM: a test applies the scheduler's news by hand, as the connector's worker hooks would.

    with KVHarness() as kv:
        pair = kv.pair(transport="cma")                  # P and D, P registered under ENGINE
        pair.sender.apply_step(registered={"p1": "x1"}, ready={"p1": ("x1", [2, 3])})
        pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [5, 6])])
        assert wait_results(pair.receiver, {"d1"}).failed == {}
        assert_copied(pair, [2, 3], [5, 6])

`KVHarness.side`, `.sender` and `.receiver` build the parts one by one (TP ranks, a D of its own, a sealer).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdkv.bootstrap import BootstrapClient, start_background
from pdkv.connector.receiver import KVReceiver, PullSpec, Results
from pdkv.connector.send_table import Phase, SendLimits
from pdkv.connector.sender import KVSender
from pdkv.wire import Region, RegisterRequest
from pdkv.transport import open_transport
from support.waiting import wait_for, waited_for

LAYERS = 3
BLOCKS = 16
BLOCK_LEN = 512  # bytes of one block in one layer's region
ENGINE = "engine-p"


@dataclass
class Side:
    """One engine's KV memory, `mem[layer, block]` one block's bytes in any shape, registered with `transport`."""

    mem: np.ndarray
    transport: Any  # MooncakeTransport, CmaTransport or SocketTransport

    @property
    def regions(self) -> list[Region]:
        layers, blocks = self.mem.shape[:2]
        block_len = self.mem[0, 0].nbytes
        base = self.mem.ctypes.data
        return [Region(base + layer * blocks * block_len, block_len, blocks) for layer in range(layers)]

    def block(self, layer: int, b: int) -> np.ndarray:
        return self.mem[layer, b]


@dataclass
class Pair:
    p: Side
    d: Side
    sender: KVSender
    receiver: KVReceiver
    bootstrap_url: str

    def spec(self, d_req: str, tid: str, blocks: list[int], first: int = 0, binding: str = "") -> PullSpec:
        return PullSpec(d_req, tid, self.bootstrap_url, ENGINE, blocks, first, binding=binding)


class KVHarness:
    """A bootstrap server on 127.0.0.1 and every part made here; `close()` (or leaving `with`) closes them all."""

    def __init__(self) -> None:
        self.stack = ExitStack()
        bs = start_background("127.0.0.1", 0)
        self.stack.callback(bs.stop)
        self.bootstrap_url = bs.url

    def side(self, fill: int | None, transport: str = "tcp", shape: tuple[int, ...] = (LAYERS, BLOCKS, BLOCK_LEN),
             mem: np.ndarray | None = None) -> Side:
        """Memory of `shape` (random non-zero bytes seeded by `fill`, or zeros for None; or `mem` as given),
        registered with a transport of `transport`."""
        if mem is None:
            rng = np.random.default_rng(fill)
            mem = rng.integers(1, 255, size=shape, dtype=np.uint8) if fill is not None else np.zeros(shape, np.uint8)
        t = self.stack.enter_context(open_transport(transport, "127.0.0.1", write_timeout_s=3.0))
        t.register([(mem.ctypes.data, mem.nbytes)])
        return Side(mem, t)

    def sender(self, side: Side, *, engine_id: str = ENGINE, tp_rank: int = 0, heartbeat_s: float = 0.2, **kw: Any) -> KVSender:
        """P's worker over `side`, registered at the bootstrap as rank `tp_rank` of `engine_id`; `kw` as KVSender's."""
        sender = self.stack.enter_context(
            KVSender(side.transport, side.regions, host="127.0.0.1", engine_id=engine_id, tp_rank=tp_rank, heartbeat_s=heartbeat_s, **kw))
        register(self.bootstrap_url, sender, engine_id, tp_rank)
        return sender

    def receiver(self, side: Side, *, liveness_s: float = 2.0, **kw: Any) -> KVReceiver:
        """D's worker over `side`; `kw` as KVReceiver's."""
        return self.stack.enter_context(KVReceiver(side.transport.session_address, side.regions, liveness_s=liveness_s, **kw))

    def pair(self, limits: SendLimits | None = None, liveness_s: float = 2.0, wait_write_s: float = 0.0, transport: str = "tcp",
             d_transport: str | None = None, p_sealer: Any = None, d_sealer: Any = None) -> Pair:
        """P (random KV) and D (zeros), TP 1 each, P registered under ENGINE."""
        p = self.side(fill=1, transport=transport)
        d = self.side(fill=None, transport=d_transport or transport)
        sender = self.sender(p, limits=limits, wait_write_s=wait_write_s, sealer=p_sealer)
        receiver = self.receiver(d, liveness_s=liveness_s, sealer=d_sealer, transport=d.transport)
        return Pair(p, d, sender, receiver, self.bootstrap_url)

    def close(self) -> None:
        self.stack.close()

    def __enter__(self) -> KVHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register(bootstrap_url: str, sender: KVSender, engine_id: str = ENGINE, tp_rank: int = 0) -> None:
    """Register `sender`'s side channel at the bootstrap, as the connector's P worker does."""
    with BootstrapClient(bootstrap_url) as c:
        c.register(RegisterRequest(engine_id=engine_id, dp_rank=0, tp_rank=tp_rank, pp_rank=0, addr=sender.address))


# --- waits on what P and D report ------------------------------------------------------


def wait_results(receiver: KVReceiver, want: Iterable[str], timeout: float = 10.0) -> Results:
    """D's results, gathered until every pull in `want` concluded (finished or failed)."""
    want = set(want)
    got = Results()

    def concluded() -> bool:
        r = receiver.take_results()
        got.finished |= r.finished
        got.failed.update(r.failed)
        got.failed_blocks.update(r.failed_blocks)
        got.transfer_ids.update(r.transfer_ids)
        return want <= got.finished

    wait_for(concluded, timeout, f"pulls {sorted(want)} to conclude", interval=0.01)
    return got


def wait_freed(sender: KVSender, want: Iterable[str], timeout: float = 10.0) -> float:
    """Seconds until P may free the blocks of every P request in `want` (sender.take_finished)."""
    want, got = set(want), set()

    def freed() -> bool:
        got.update(sender.take_finished())
        return want <= got

    return waited_for(freed, timeout, f"P requests {sorted(want)} to be freed", interval=0.01)


def phase(sender: KVSender, tid: str) -> Phase | None:
    """Where P's table is with transfer `tid` (None: P knows nothing of it).

    Read from the test's thread while the sender's loop thread writes the table: a dict lookup and an attribute read,
    each atomic in CPython, which is all a wait needs."""
    e = sender.table.entries.get(tid)
    return None if e is None else e.phase


def parked(sender: KVSender, tid: str) -> bool:
    """D's pull of `tid` reached P and waits there for the KV (P's table holds it, as phase() reads the table)."""
    e = sender.table.entries.get(tid)
    return e is not None and bool(e.pulls)


def wait_parked(sender: KVSender, tid: str, timeout: float = 5.0) -> None:
    wait_for(lambda: parked(sender, tid), timeout, f"D's pull of {tid} to be parked at P", interval=0.01)


def wait_phase(sender: KVSender, tid: str, want: Phase, timeout: float = 5.0) -> None:
    wait_for(lambda: phase(sender, tid) is want, timeout, f"P's transfer {tid} to be {want}", interval=0.01)


def wait_holding(sender: KVSender, tid: str, timeout: float = 5.0) -> None:
    """Until P has the KV of `tid`: held for a pull, or being or already sent to a pull that was waiting."""
    wait_for(lambda: phase(sender, tid) in (Phase.READY, Phase.SENDING, Phase.CLOSED), timeout, f"P to have the KV of {tid}",
             interval=0.01)


# --- what landed in D's memory -----------------------------------------------------------


def assert_copied(pair: Pair, p_blocks: list[int], d_blocks: list[int]) -> None:
    for layer in range(pair.d.mem.shape[0]):
        for pb, db in zip(p_blocks, d_blocks, strict=True):
            assert np.array_equal(pair.p.block(layer, pb), pair.d.block(layer, db)), f"layer {layer} block {pb}->{db}"


def assert_untouched(pair: Pair, d_blocks: list[int]) -> None:
    for layer in range(pair.d.mem.shape[0]):
        for b in range(pair.d.mem.shape[1]):
            if b not in d_blocks:
                assert not pair.d.block(layer, b).any(), f"layer {layer} block {b} was written"


def settle(sender: KVSender, timeout: float = 5.0) -> None:
    """Return once P's loop thread has run all it was given before this call: a probe transfer registered through
    `apply_step` (queued behind it) shows in P's table. Before a check that something did not happen."""
    probe = f"settle-{next(_probes)}"
    sender.apply_step(registered={probe: probe})
    wait_phase(sender, probe, Phase.RUNNING, timeout)


_probes = itertools.count()

"""P and D of different TP sizes over real ZMQ, a real bootstrap server and real Mooncake tcp (or cma, or socket with
P writing layer by layer) on loopback.

Each TP rank is a KVSender or KVReceiver of its own, with memory shaped as vLLM's LBHNC cache: per layer a
region of blocks, each block the rank's heads one after another. P ranks hold random bytes; after the pull,
every D rank must hold exactly the heads its rank owns, taken from the P rank(s) that own them, in the blocks
it asked for, and nothing else. No vLLM: the scheduler's news is applied by hand, as the worker hooks would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
from support.kv_pair import KVHarness, Side, wait_freed, wait_parked, wait_results
from support.slow_link import LateForwarder

from pdkv.connector.layer_writes import LayerBoard
from pdkv.connector.receiver import PullSpec, Results
from pdkv.tp_heads import rank_heads

HEADS = 4  # the model's KV heads
UNIT = 128  # bytes of one head in one block of one layer (K and V of its tokens)
LAYERS = 2
BLOCKS = 16
ENGINE = "engine-tp"


@dataclass
class Rank:
    side: Side  # mem: LAYERS x BLOCKS x heads x UNIT bytes
    first_head: int

    @property
    def mem(self) -> np.ndarray:
        return self.side.mem


def make_rank(kv: KVHarness, tp: int, rank: int, transport: str, fill: bool, heads: int = HEADS) -> Rank:
    first, count = rank_heads(heads, tp, rank)
    return Rank(kv.side(fill=rank if fill else None, transport=transport, shape=(LAYERS, BLOCKS, count, UNIT)), first)


class Deployment:
    """P of TP p and D of TP d, every rank registered as the connector's workers do."""

    def __init__(
        self, kv: KVHarness, p_tp: int, d_tp: int, transport: str, *, heads: int = HEADS, d_kv_heads: int | None = None,
        liveness_s: float = 3.0, bootstrap_timeout: float = 2.0, layers: bool = False,
    ) -> None:
        """`layers`: P's ranks write layer by layer (socket_write_layers), one region a layer."""
        self.bootstrap = kv.bootstrap_url
        self.ps = [make_rank(kv, p_tp, r, transport, fill=True, heads=heads) for r in range(p_tp)]
        self.ds = [make_rank(kv, d_tp, r, transport, fill=False, heads=heads) for r in range(d_tp)]
        self.senders = [kv.sender(p.side, engine_id=ENGINE, tp_rank=r, tp_size=p_tp, kv_heads=heads,
                                  layers=LayerBoard([(i,) for i in range(LAYERS)], wait_s=3.0) if layers else None)
                        for r, p in enumerate(self.ps)]
        self.receivers = [kv.receiver(d.side, tp_rank=r, tp_size=d_tp, kv_heads=heads if d_kv_heads is None else d_kv_heads,
                                      liveness_s=liveness_s, bootstrap_timeout=bootstrap_timeout, transport=d.side.transport)
                          for r, d in enumerate(self.ds)]

    def transfer(self, tid: str, p_blocks: list[int], d_blocks: list[int]) -> list[Results]:
        spec = PullSpec("d1", tid, self.bootstrap, ENGINE, d_blocks)
        for rx in self.receivers:  # the scheduler's metadata reaches every worker alike
            rx.apply_step(pulls=[spec])
        for sender in self.senders:
            sender.apply_step(registered={"p1": tid}, ready={"p1": (tid, p_blocks)})
        return [wait_results(rx, {"d1"}) for rx in self.receivers]

    def head(self, global_head: int) -> tuple[Rank, int]:
        """The first P rank holding `global_head`, and the head's index in its blocks."""
        p = next(p for p in self.ps if p.first_head <= global_head < p.first_head + p.mem.shape[2])
        return p, global_head - p.first_head


CASES = [(1, 2, "tcp"), (2, 1, "tcp"), (1, 2, "cma"), (2, 1, "cma"), (4, 2, "tcp"), (1, 4, "cma")]


@pytest.mark.parametrize(("p_tp", "d_tp", "transport"), CASES, ids=[f"p{p}-d{d}-{t}" for p, d, t in CASES])
def test_every_d_rank_gets_exactly_its_heads_from_the_p_ranks_that_hold_them(kv, p_tp, d_tp, transport):
    p_blocks, d_blocks = [2, 3, 4, 9, 11], [5, 6, 7, 12, 0]  # a run, a jump, a block going back on D's side
    dep = Deployment(kv, p_tp, d_tp, transport)
    for res in dep.transfer("x-tp", p_blocks, d_blocks):
        assert res.failed == {}
    assert_heads(dep, p_blocks, d_blocks)
    for sender in dep.senders:
        if sender.trace.get("x-tp") is not None and sender.trace.get("x-tp").bytes:
            wait_freed(sender, {"p1"})
    # Each P rank's record says what it moved; together they are the whole prompt's KV, once.
    records = [s.trace.get("x-tp") for s in dep.senders]
    moved = sum(t.bytes for t in records if t is not None)
    assert moved == len(p_blocks) * LAYERS * HEADS * UNIT
    if d_tp > p_tp:
        assert all(len(t.d_rank_bytes) == d_tp // p_tp for t in records)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)], ids=["p1-d2", "p2-d1"])
def test_written_layer_by_layer_every_d_rank_gets_exactly_its_heads(kv, p_tp, d_tp):
    # Over socket, every P rank writing each layer as its forward reports it; D's pulls wait at P before the forward.
    p_blocks, d_blocks = [2, 3, 4, 9], [5, 6, 7, 12]
    dep = Deployment(kv, p_tp, d_tp, "socket", layers=True)
    spec = PullSpec("d1", "x-layers", dep.bootstrap, ENGINE, d_blocks)
    for rx in dep.receivers:
        rx.apply_step(pulls=[spec])
    items = {"p1": ("x-layers", p_blocks)}
    for sender in dep.senders:
        sender.apply_step(registered={"p1": "x-layers"})
        wait_parked(sender, "x-layers")  # D rank(s) pulling this P rank asked first
        sender.prompt_starts(items)
    for layer in range(LAYERS):
        for sender in dep.senders:  # each rank's model runner reports its own layers
            sender.layer_ready(layer)
    for sender in dep.senders:
        sender.prompt_done(items)
    for rx in dep.receivers:
        res = wait_results(rx, {"d1"})
        assert res.failed == {}, res.failed
    assert_heads(dep, p_blocks, d_blocks)
    for sender in dep.senders:
        sender.apply_step(ready={"p1": ("x-layers", p_blocks)})
        wait_freed(sender, {"p1"})
    assert sum(s.trace.get("x-layers").bytes for s in dep.senders) == len(p_blocks) * LAYERS * HEADS * UNIT


def assert_heads(dep: Deployment, p_blocks: list[int], d_blocks: list[int]) -> None:
    """Every D rank holds, in the blocks it asked for, exactly its heads from the P rank(s) holding them; nothing else."""
    for d in dep.ds:
        for layer in range(LAYERS):
            for b in range(BLOCKS):
                for h in range(d.mem.shape[2]):
                    got = d.mem[layer, b, h]
                    if b not in d_blocks:
                        assert not got.any(), f"block {b} of D was written"
                        continue
                    p, ph = dep.head(d.first_head + h)
                    want = p.mem[layer, p_blocks[d_blocks.index(b)], ph]
                    assert np.array_equal(got, want), f"layer {layer} block {b} head {d.first_head + h}"


def test_p_ranks_holding_replicated_heads_nobody_pulls_are_released_at_once(kv):
    # 2 KV heads over P TP 4: ranks 0-1 hold head 0, ranks 2-3 head 1. D TP 1 pulls ranks 0 and 2 and releases 1
    # and 3, whose blocks are freed now rather than at expiry (120 s).
    dep = Deployment(kv, 4, 1, "cma", heads=2)
    assert all(res.failed == {} for res in dep.transfer("x-4-1", [1, 2], [3, 4]))
    assert_heads(dep, [1, 2], [3, 4])
    for sender in dep.senders:
        wait_freed(sender, {"p1"}, timeout=5.0)
    assert [s.trace.get("x-4-1").bytes for s in dep.senders] == [2 * LAYERS * UNIT, 0, 2 * LAYERS * UNIT, 0]


def test_a_d_rank_that_finds_p_too_late_tells_p_and_p_frees_the_blocks_at_once(kv):
    # P TP 1, D TP 2 over cma: D rank 1 learns P's side channel from a bootstrap that answers after the pull's
    # liveness bound (a first pull on a host whose cores are all busy). The pull fails there before P was asked,
    # and P, which had served rank 0's share, would hold the blocks for rank 1's until they expire (120 s): rank
    # 1 tells P it will not pull once it knows where P is, and P frees them now.
    dep = Deployment(kv, 1, 2, "cma", liveness_s=2.0, bootstrap_timeout=10.0)
    late = kv.stack.enter_context(LateForwarder(dep.bootstrap, delay_s=3.0))
    for rank, rx in enumerate(dep.receivers):
        rx.apply_step(pulls=[PullSpec("d1", "x-late", late.url if rank else dep.bootstrap, ENGINE, [5, 6])])
    dep.senders[0].apply_step(registered={"p1": "x-late"}, ready={"p1": ("x-late", [2, 3])})
    first, second = (wait_results(rx, {"d1"}) for rx in dep.receivers)
    assert first.failed == {}
    assert "prefill side not reached within 2 s" in second.failed["d1"], second.failed
    wait_freed(dep.senders[0], {"p1"}, timeout=8.0)
    assert dep.senders[0].table.holding() == 0


def test_a_d_whose_model_has_other_heads_is_refused_at_once(kv):
    dep = Deployment(kv, 1, 2, "tcp", d_kv_heads=8)
    start = time.monotonic()
    results = dep.transfer("x-bad", [1], [2])
    assert time.monotonic() - start < 3.0
    for res in results:
        assert "decode's model has 8 KV heads, prefill's 4" in res.failed["d1"], res.failed
    for d in dep.ds:
        assert not d.mem.any()


def test_a_d_of_another_tp_size_that_does_not_know_the_head_count_fails_with_the_reason(kv):
    dep = Deployment(kv, 1, 2, "tcp", d_kv_heads=0)
    for res in dep.transfer("x-unknown", [1], [2]):
        assert "unequal TP needs the model's KV head count" in res.failed["d1"], res.failed

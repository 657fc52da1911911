"""P writing a prompt's KV layer by layer over the socket transport (socket_write_layers), P and D in one process over
real sockets: each layer lands while the forward still runs, D hears DONE once after the last lands, one refused layer
or a connection cut between layers fails the pull once (D recomputes), and P forgets the forward once the blocks are
freed.

No vLLM: the test plays the worker's hooks (prompt_starts before the forward, layer_ready as vLLM's save_kv_layer,
prompt_done after it; the KV is in host memory, so a layer is there once it is reported)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from pdkv.connector.layer_writes import LayerBoard
from pdkv.connector.pulls import write_key
from support.kv_pair import LAYERS, KVHarness, Pair, assert_copied, wait_freed, wait_parked, wait_results
from support.waiting import wait_for, wait_until


@pytest.fixture
def kv() -> Iterator[KVHarness]:
    with KVHarness() as h:
        yield h


def layered(kv: KVHarness, groups: int | None = None) -> tuple[Pair, LayerBoard]:
    """P (random KV) and D (zeros) over the socket transport, P writing layer by layer (one region per layer), in
    `groups` writes a forward (none: one a layer)."""
    p = kv.side(fill=1, transport="socket")
    d = kv.side(fill=None, transport="socket")
    board = LayerBoard([(i,) for i in range(LAYERS)], wait_s=3.0, groups=groups)
    sender = kv.sender(p, layers=board)
    receiver = kv.receiver(d, transport=d.transport)
    return Pair(p, d, sender, receiver, kv.bootstrap_url), board


def landed(pair: Pair, layer: int, p_blocks: list[int], d_blocks: list[int]) -> bool:
    return all(np.array_equal(pair.p.block(layer, pb), pair.d.block(layer, db)) for pb, db in zip(p_blocks, d_blocks, strict=True))


def untouched(pair: Pair, layer: int, d_blocks: list[int]) -> bool:
    return not any(pair.d.block(layer, b).any() for b in d_blocks)


def forward_with_a_waiting_pull(pair: Pair) -> dict[str, tuple[str, list[int]]]:
    """D's pull d1 of transfer x1 (P's blocks 2, 3 into D's 5, 6) waiting at P, then P's forward that completes that
    prompt begun: the items prompt_starts was given."""
    items = {"p1": ("x1", [2, 3])}
    pair.sender.apply_step(registered={"p1": "x1"})
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [5, 6])])
    wait_parked(pair.sender, "x1")
    pair.sender.prompt_starts(items)
    return items


def concluded(pair: Pair) -> int:
    """How many transfers P concluded, whatever the outcome (each test makes one)."""
    reg = pair.sender.trace.registry
    return int(sum(s.value for m in reg.collect() if m.name == "pdkv_connector_transfers" for s in m.samples
                   if s.name.endswith("_total") and s.labels.get("role") == "prefill"))


def test_a_pull_waiting_before_the_forward_gets_each_layer_as_it_is_computed_and_done_once_after_the_last(kv):
    pair, board = layered(kv)
    items = forward_with_a_waiting_pull(pair)
    for layer in range(LAYERS):
        assert all(untouched(pair, later, [5, 6]) for later in range(layer, LAYERS))  # not computed yet: not written
        pair.sender.layer_ready(layer)
        wait_for(lambda layer=layer: landed(pair, layer, [2, 3], [5, 6]), 5, f"layer {layer} to land in D")
        if layer < LAYERS - 1:
            assert "d1" not in pair.receiver.take_results().finished  # no DONE before the last layer landed
    assert wait_results(pair.receiver, {"d1"}).failed == {}  # every layer landed: D may go on before P's forward ends
    pair.sender.prompt_done(items)
    assert_copied(pair, [2, 3], [5, 6])
    t = pair.sender.trace.get("x1")
    assert t is not None and t.status == "sent" and t.bytes == 2 * LAYERS * pair.p.mem[0, 0].nbytes
    assert t.events["transfer_end"] <= t.events["p_forward_done"]  # the write ran beside the forward
    assert "kv_ready" not in t.events
    pair.sender.apply_step(ready={"p1": ("x1", [2, 3])})
    wait_freed(pair.sender, {"p1"})
    assert concluded(pair) == 1
    assert board.remembered() == 0


def test_in_two_groups_the_first_lands_once_its_layer_is_computed_and_the_rest_only_with_the_last_layer(kv):
    pair, _ = layered(kv, groups=2)  # LAYERS = 3: layer 0, then layers 1-2
    items = forward_with_a_waiting_pull(pair)
    pair.sender.layer_ready(0)
    wait_for(lambda: landed(pair, 0, [2, 3], [5, 6]), 5, "the first group to land in D")
    pair.sender.layer_ready(1)
    # layer 1 is computed but its group is not whole: nothing of it is written
    assert not wait_until(lambda: not untouched(pair, 1, [5, 6]), 0.3)
    pair.sender.layer_ready(2)
    assert wait_results(pair.receiver, {"d1"}).failed == {}
    pair.sender.prompt_done(items)
    assert_copied(pair, [2, 3], [5, 6])
    pair.sender.apply_step(ready={"p1": ("x1", [2, 3])})
    wait_freed(pair.sender, {"p1"})
    assert concluded(pair) == 1


def test_a_pull_mid_forward_takes_the_layers_already_there_and_a_pull_after_it_everything_at_once(kv):
    pair, board = layered(kv)
    items = {"p1": ("x1", [1, 2, 3])}
    pair.sender.apply_step(registered={"p1": "x1"}, fanout={"x1": 2})
    pair.sender.prompt_starts(items)
    pair.sender.layer_ready(0)
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [7, 8, 9])])
    wait_for(lambda: landed(pair, 0, [1, 2, 3], [7, 8, 9]), 5, "the layer computed before the pull came")
    assert untouched(pair, 1, [7, 8, 9])
    pair.sender.prompt_done(items)  # layers 1.. never reported (a replayed CUDA graph): ready at the forward's end
    assert wait_results(pair.receiver, {"d1"}).failed == {}
    pair.receiver.apply_step(pulls=[pair.spec("d2", "x1", [10, 11, 12])])  # the second choice, after the forward
    assert wait_results(pair.receiver, {"d2"}).failed == {}
    assert_copied(pair, [1, 2, 3], [7, 8, 9])
    assert_copied(pair, [1, 2, 3], [10, 11, 12])
    pair.sender.apply_step(ready={"p1": ("x1", [1, 2, 3])})
    wait_freed(pair.sender, {"p1"})
    assert board.remembered() == 0


def test_both_choices_pulling_during_the_forward_before_registration_get_the_kv_and_the_blocks_free_after_both(kv):
    # vLLM binds a step's metadata (the worker's forward_begins) before start_load_kv (start_step): the choices (n)
    # come with the former, the registration reaches the sender's loop with the latter, after the writes may be done.
    pair, board = layered(kv)
    items = {"p1": ("x1", [1, 2])}
    pair.sender.apply_step(fanout={"x1": 2})
    pair.sender.prompt_starts(items)
    pair.receiver.apply_step(pulls=[pair.spec("d1", "x1", [7, 8]), pair.spec("d2", "x1", [10, 11])])
    for layer in range(LAYERS):
        pair.sender.layer_ready(layer)
    pair.sender.prompt_done(items)
    assert wait_results(pair.receiver, {"d1", "d2"}).failed == {}  # neither refused as a pull beyond n
    assert_copied(pair, [1, 2], [7, 8])
    assert_copied(pair, [1, 2], [10, 11])
    pair.sender.apply_step(registered={"p1": "x1"}, fanout={"x1": 2})
    pair.sender.apply_step(ready={"p1": ("x1", [1, 2])})
    wait_freed(pair.sender, {"p1"})
    assert board.remembered() == 0


@pytest.mark.parametrize("breaks", ["refused", "cut"])
def test_a_layer_that_cannot_land_fails_the_pull_once_with_every_block_and_the_blocks_are_freed(kv, breaks):
    """After layer 0 landed, D refuses the pull's writes (it forgot the pull) or its connections are cut (its listener
    closed): the next layer's write fails, D hears it once with every block (it recomputes them), P frees them."""
    pair, board = layered(kv)
    items = forward_with_a_waiting_pull(pair)
    pair.sender.layer_ready(0)
    wait_for(lambda: landed(pair, 0, [2, 3], [5, 6]), 5, "layer 0 to land in D")
    if breaks == "refused":
        pair.d.transport.forget(write_key("x1", "d1"))
    else:
        pair.d.transport.close()
    pair.sender.layer_ready(1)
    got = wait_results(pair.receiver, {"d1"})
    assert "transfer failed" in got.failed["d1"] and got.failed_blocks["d1"] == (5, 6)
    pair.sender.layer_ready(2)
    pair.sender.prompt_done(items)
    assert untouched(pair, 1, [5, 6]) and untouched(pair, 2, [5, 6])
    t = pair.sender.trace.get("x1")
    assert t is not None and t.status == "failed" and (breaks != "refused" or "refused" in t.error)
    pair.sender.apply_step(ready={"p1": ("x1", [2, 3])})
    wait_freed(pair.sender, {"p1"})
    assert concluded(pair) == 1
    assert board.remembered() == 0


"""Writing a prompt's KV layer by layer (socket_write_layers): which layers a pull's write takes when, that it ends
once, and that one failing layer ends it. No sockets: a transport that records what it was asked to write."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pdkv.connector.layer_writes import MAX_TRANSFERS, ForwardLayers, LayerBoard, LayerCursor, group_ends
from pdkv.connector.layout import TensorInfo, layer_regions, regions_for_caches
from pdkv.connector.send_table import StartSend
from pdkv.connector.writers import write_layers
from pdkv.errors import TransferError
from pdkv.wire import Announce, PullRequest, Region

LAYERS = 3
BLOCKS = 8
BLOCK_LEN = 64
P_REGIONS = [Region(0x10000 + i * BLOCKS * BLOCK_LEN, BLOCK_LEN, BLOCKS) for i in range(2 * LAYERS)]  # K and V apart
D_REGIONS = [Region(0x90000 + i * BLOCKS * BLOCK_LEN, BLOCK_LEN, BLOCKS) for i in range(2 * LAYERS)]
GROUPS = [(2 * i, 2 * i + 1) for i in range(LAYERS)]  # layer i: regions 2i (K) and 2i+1 (V)


class Fence:
    """A GPU event stand-in: `synchronize` records that the writer waited for it."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")


class RecordingTransport:
    """What write_layers asked to write, one entry per write: the local regions' bases. `fail_at`: the write of that
    number (0 the first) raises, as a cut connection does."""

    def __init__(self, log: list[str] | None = None, fail_at: int | None = None) -> None:
        self.log = log if log is not None else []
        self.writes: list[list[int]] = []
        self.fail_at = fail_at
        self.wrote = threading.Condition()

    def connect(self, peer: str, hello: object) -> None:
        pass

    def write_blocks(self, peer, local_blocks, remote_blocks, local_regions, remote_regions, heads=None, *, transfer=""):
        assert [r.base for r in remote_regions] == [D_REGIONS[P_REGIONS.index(r)].base for r in local_regions]
        with self.wrote:
            n = len(self.writes)
            self.writes.append([P_REGIONS.index(r) for r in local_regions])
            self.wrote.notify_all()
        self.log.append(f"write {self.writes[-1]}")
        if n == self.fail_at:
            raise TransferError("the connection to decode's socket listener failed mid-transfer: reset")
        return len(local_blocks) * BLOCK_LEN * len(local_regions), len(local_regions)


def start(blocks: list[int] | None = None) -> StartSend:
    blocks = blocks or [1, 2, 3]
    session = "socket://127.0.0.1:1/" + "00" * 16
    req = PullRequest(transfer_id="x1", d_req_id="d1", session=session, tp_rank=0, tp_size=1, block_ids=[4, 5, 6][: len(blocks)])
    announced = Announce(session=session, tp_rank=0, tp_size=1, regions=D_REGIONS)
    return StartSend("x1", "p1", blocks, SimpleNamespace(request=req, announced=announced, heads=None))


class Writer:
    """write_layers on a thread of its own, as a transfer thread runs it: its one outcome and its trace events."""

    def __init__(self, transport: RecordingTransport, cursor: LayerCursor) -> None:
        self.events: list[str] = []
        self.outcomes: list[object] = []
        self._thread = threading.Thread(target=self._run, args=(transport, cursor), daemon=True)
        self._thread.start()

    def _run(self, transport: RecordingTransport, cursor: LayerCursor) -> None:
        try:
            self.outcomes.append(write_layers(transport, P_REGIONS, start(), cursor, lambda name, **_: self.events.append(name)))
        except TransferError as exc:
            self.outcomes.append(exc)

    def join(self) -> object:
        self._thread.join(10)
        assert not self._thread.is_alive(), "the write did not end"
        assert len(self.outcomes) == 1
        return self.outcomes[0]


def wait_writes(t: RecordingTransport, n: int) -> None:
    with t.wrote:
        assert t.wrote.wait_for(lambda: len(t.writes) >= n, 10), f"{n} writes"


def test_layer_regions_name_each_layer_once_and_layers_sharing_a_cache_share_an_index():
    k_v = [TensorInfo(f"model.layers.{i}.attn", 0x1000 * (i + 1), (2, 4, 16), (64, 16, 1), 2) for i in range(2)]
    shared = TensorInfo("model.layers.2.attn", 0x1000, (2, 4, 16), (64, 16, 1), 2)  # layer 2 reuses layer 0's cache
    tensors = [*k_v, shared]
    regions = regions_for_caches(tensors, 4)
    of_name, groups = layer_regions(tensors, 4, regions)
    assert groups == [(0, 1), (2, 3)]
    assert of_name == {"model.layers.0.attn": 0, "model.layers.1.attn": 1, "model.layers.2.attn": 0}


def test_a_cursor_takes_each_ready_layer_once_in_order_and_the_forwards_end_readies_the_rest():
    forward = ForwardLayers(4, group_ends(4, 4))
    cursor = LayerCursor(LayerBoard(GROUPS), forward)
    assert cursor.take() == []
    forward.mark(2, "e2")
    forward.mark(0, "e0")
    forward.mark(0, "again")  # a layer is ready once; the first fence stands
    forward.mark(9, "e9")  # not a layer of this forward
    assert cursor.take() == [(0, "e0"), (2, "e2")]
    assert cursor.take() == [] and not cursor.finished
    forward.finish("end")
    assert cursor.take() == [(1, "end"), (3, "end")]
    assert cursor.finished and forward.done


@pytest.mark.parametrize(("layers", "groups", "ends"), [
    (36, 6, [6, 12, 18, 24, 30, 36]), (36, 36, list(range(1, 37))), (36, 100, list(range(1, 37))),
    (10, 3, [3, 6, 10]), (3, 1, [3]), (1, 6, [1]),
])
def test_groups_cut_the_layers_into_even_runs_of_neighbours_at_most_one_a_layer(layers, groups, ends):
    assert group_ends(layers, groups) == ends


def test_a_cursor_takes_a_group_once_every_layer_of_it_is_ready_and_never_part_of_one():
    forward = ForwardLayers(6, group_ends(6, 3))  # groups: layers 0-1, 2-3, 4-5
    cursor = LayerCursor(LayerBoard([(i,) for i in range(6)], groups=3), forward)
    forward.mark(0, "e0")
    forward.mark(3, "e3")
    assert cursor.take() == []  # no group whole yet
    forward.mark(1, "e1")
    assert cursor.take() == [(0, "e0"), (1, "e1")]
    forward.mark(5, "e5")
    forward.mark(4, "e4")
    assert cursor.take() == [(4, "e4"), (5, "e5")]  # a later group whole before an earlier one goes first
    forward.finish("end")
    assert cursor.take() == [(2, "end"), (3, "e3")] and cursor.finished


def test_a_forward_in_two_groups_is_two_writes_each_once_every_layer_of_its_group_is_computed():
    board = LayerBoard(GROUPS, wait_s=10, groups=2)  # groups: layer 0; layers 1-2
    board.open(["x1"])
    t = RecordingTransport()
    writer = Writer(t, board.cursor("x1"))
    board.layer_ready(0, None)
    wait_writes(t, 1)
    board.layer_ready(1, None)
    with t.wrote:
        assert not t.wrote.wait_for(lambda: len(t.writes) > 1, 0.2), "layer 1 went before its group was whole"
    board.layer_ready(2, None)
    wait_writes(t, 2)
    board.forward_done(None)
    writer.join()
    assert t.writes == [[0, 1], [2, 3, 4, 5]]


def test_a_pull_before_the_forward_writes_each_layer_as_it_comes_after_waiting_for_its_event():
    log: list[str] = []
    board = LayerBoard(GROUPS, wait_s=10)
    board.open(["x1"])
    t = RecordingTransport(log)
    writer = Writer(t, board.cursor("x1"))
    for layer in range(LAYERS):
        board.layer_ready(layer, Fence(f"e{layer}", log))
        wait_writes(t, layer + 1)  # written before the next layer is computed
    assert board.forward_done(Fence("end", log))
    assert writer.join() == (3 * BLOCK_LEN * 2 * LAYERS, 2 * LAYERS)
    assert t.writes == [[0, 1], [2, 3], [4, 5]]
    assert log == ["wait e0", "write [0, 1]", "wait e1", "write [2, 3]", "wait e2", "write [4, 5]"]
    assert writer.events == ["transfer_start", "transfer_end"]


def test_a_pull_mid_forward_writes_the_layers_already_there_at_once_then_the_rest_as_they_come():
    board = LayerBoard(GROUPS, wait_s=10)
    board.open(["x1"])
    board.layer_ready(0, None)
    board.layer_ready(1, None)
    t = RecordingTransport()
    writer = Writer(t, board.cursor("x1"))
    wait_writes(t, 1)
    assert t.writes == [[0, 1, 2, 3]]
    board.forward_done(None)  # layer 2 never reported (a replayed CUDA graph): ready with the forward's end
    writer.join()
    assert t.writes == [[0, 1, 2, 3], [4, 5]]


def test_a_pull_after_the_forward_is_one_write_of_every_layer():
    log: list[str] = []
    board = LayerBoard(GROUPS)
    board.open(["x1"])
    for layer in range(LAYERS):
        board.layer_ready(layer, Fence(f"e{layer}", log))
    board.forward_done(Fence("end", log))
    t = RecordingTransport(log)
    Writer(t, board.cursor("x1")).join()
    assert t.writes == [[0, 1, 2, 3, 4, 5]]
    # One wait, for the last layer's event: the layers' events are recorded in order on the forward's stream.
    assert log == ["wait e2", "write [0, 1, 2, 3, 4, 5]"]


def test_a_batch_with_a_layer_never_reported_waits_for_the_forwards_closing_fence():
    log: list[str] = []
    board = LayerBoard(GROUPS)
    board.open(["x1"])
    board.layer_ready(0, Fence("e0", log))
    board.layer_ready(2, Fence("e2", log))  # layer 1 never reported: its fence is the forward's end, recorded last
    board.forward_done(Fence("end", log))
    t = RecordingTransport(log)
    Writer(t, board.cursor("x1")).join()
    assert log == ["wait end", "write [0, 1, 2, 3, 4, 5]"]


def test_a_layer_wakes_the_writes_only_when_it_makes_its_group_whole():
    forward = ForwardLayers(6, group_ends(6, 2))  # groups: layers 0-2 and 3-5
    assert [forward.mark(i, None) for i in (0, 2, 4, 5)] == [False, False, False, False]
    assert forward.mark(1, None) is True  # 0-2 whole
    assert forward.mark(1, None) is False  # already marked
    assert forward.mark(3, None) is True and forward.in_whole_groups() == [0, 1, 2, 3, 4, 5]
    assert forward.mark(9, None) is False  # no such layer


def test_a_failing_layer_ends_the_write_once_and_no_later_layer_is_written():
    board = LayerBoard(GROUPS, wait_s=10)
    board.open(["x1"])
    t = RecordingTransport(fail_at=1)
    writer = Writer(t, board.cursor("x1"))
    board.layer_ready(0, None)
    wait_writes(t, 1)
    board.layer_ready(1, None)
    outcome = writer.join()
    assert isinstance(outcome, TransferError) and "mid-transfer" in str(outcome)
    board.layer_ready(2, None)
    board.forward_done(None)
    assert t.writes == [[0, 1], [2, 3]]
    assert writer.events == ["transfer_start"]  # no transfer_end: the write failed


def test_two_pulls_of_one_transfer_each_write_every_layer_and_a_later_forward_is_its_own():
    board = LayerBoard(GROUPS, wait_s=10)
    board.open(["x1"])
    first, second = RecordingTransport(), RecordingTransport()
    w1 = Writer(first, board.cursor("x1"))
    board.layer_ready(0, None)
    wait_writes(first, 1)
    w2 = Writer(second, board.cursor("x1"))  # e.g. the second of n = 2 choices
    wait_writes(second, 1)
    board.forward_done(None)
    board.open(["x2"])  # the next forward marks its own layers
    board.layer_ready(2, None)
    w1.join()
    w2.join()
    assert [j for w in first.writes for j in w] == [j for w in second.writes for j in w] == list(range(2 * LAYERS))
    assert board.cursor("x2").forward.fences == {2: None}


def test_no_layer_in_time_or_a_closed_board_fails_the_write_and_every_transfer_is_forgotten_in_the_end():
    board = LayerBoard(GROUPS, wait_s=0.05)
    board.open(["x1", "x2"])
    with pytest.raises(TransferError, match="no further layer"):
        board.next_layers(board.cursor("x1"), 0.01)
    t = RecordingTransport()
    writer = Writer(t, board.cursor("x2"))
    board.layer_ready(0, None)
    wait_writes(t, 1)
    board.close()
    assert isinstance(writer.join(), TransferError)
    assert board.remembered() == 0
    board.open(["x3"])
    board.drop("x3")
    assert board.cursor("x3") is None


def test_closing_the_board_fails_a_write_waiting_for_a_layer_at_once_not_at_its_bound():
    board = LayerBoard(GROUPS, wait_s=30)
    board.open(["x1"])
    t = RecordingTransport()
    writer = Writer(t, board.cursor("x1"))
    board.layer_ready(0, None)
    wait_writes(t, 1)
    time.sleep(0.3)  # the writer is now inside its wait for layer 1 (a close before it would be seen without a wake-up)
    began = time.monotonic()
    board.close()
    assert isinstance(writer.join(), TransferError)
    assert time.monotonic() - began < 5


def test_a_board_remembers_at_most_its_bound_of_transfers_and_an_unended_forward_is_ended_by_the_next():
    board = LayerBoard(GROUPS)
    board.open(f"x{i}" for i in range(MAX_TRANSFERS + 5))
    assert board.remembered() == MAX_TRANSFERS and board.cursor("x0") is None
    old = board.cursor(f"x{MAX_TRANSFERS}")
    board.open(["y"], stale_fence="launched-before")
    assert old.take() == [(i, "launched-before") for i in range(LAYERS)]


def test_an_off_board_opens_nothing():
    board = LayerBoard()
    board.open(["x1"])
    board.layer_ready(0, None)
    assert not board.on and board.cursor("x1") is None and not board.forward_done(None)


@pytest.mark.parametrize("groups", [None, 5])
def test_layers_marked_from_one_thread_while_many_writers_take_them_are_each_written_once_per_writer(groups):
    board = LayerBoard([(i,) for i in range(32)], wait_s=10, groups=groups)
    ends = set(group_ends(32, groups or 32))
    split: list[int] = []
    board.open(["x1"])
    cursors = [board.cursor("x1") for _ in range(8)]
    taken: list[list[int]] = [[] for _ in cursors]

    def take(k: int) -> None:
        while batch := cursors[k].next():
            if batch[-1][0] + 1 not in ends:
                split.append(batch[-1][0])  # a batch that ends inside a group
            taken[k].extend(i for i, _ in batch)

    threads = [threading.Thread(target=take, args=(k,)) for k in range(len(cursors))]
    for th in threads:
        th.start()
    for layer in range(32):
        board.layer_ready(layer, None)
    board.forward_done(None)
    for th in threads:
        th.join(10)
    assert not any(th.is_alive() for th in threads), "a writer did not end"
    assert all(sorted(t) == list(range(32)) for t in taken)
    assert split == []

"""How the socket transport packs GPU ranges into staging batches and the copy kernel's rows (pure; the copies
themselves run in tests/gpu/test_socket_gpu.py)."""

from __future__ import annotations

from pdkv.transport.sockets.staging import batch_bytes, copy_rows, kernel_fits, packed

KIB = 1 << 10


def test_many_small_ranges_share_a_batch_and_a_long_one_runs_on_into_the_next():
    # 63 scattered 64 KiB blocks in a 1 MiB batch: 16 a batch, the wire order kept.
    blocks = [(0x10000000 + b * 3 * 64 * KIB, 64 * KIB) for b in range(63)]
    batches = packed(blocks, 1024 * KIB)
    assert [len(b) for b in batches] == [16, 16, 16, 15]
    assert [batch_bytes(b) for b in batches] == [1024 * KIB] * 3 + [15 * 64 * KIB]
    assert [(a, n) for b in batches for a, _, n in b] == blocks
    assert batches[1][0] == (blocks[16][0], 0, 64 * KIB) and batches[1][1] == (blocks[17][0], 64 * KIB, 64 * KIB)
    # A range longer than what is left of a batch is cut at the batch's end and goes on.
    assert packed([(0, 10), (100, 3)], 4) == [[(0, 0, 4)], [(4, 0, 4)], [(8, 0, 2), (100, 2, 2)], [(102, 0, 1)]]
    assert packed([], 4) == []


def test_the_kernel_rows_cut_each_range_and_point_into_the_buffer_by_direction():
    batch = [(0x1000, 0, 96 * KIB), (0x9000_0000, 96 * KIB, 16)]
    gather = copy_rows(batch, 0x7F00_0000, gather=True, row=64 * KIB).tolist()
    assert gather == [[0x1000, 0x7F00_0000, 64 * KIB], [0x1000 + 64 * KIB, 0x7F00_0000 + 64 * KIB, 32 * KIB],
                      [0x9000_0000, 0x7F00_0000 + 96 * KIB, 16]]
    scatter = copy_rows(batch, 0x7F00_0000, gather=False, row=64 * KIB).tolist()
    assert scatter == [[d, s, n] for s, d, n in gather]
    assert sum(n for *_, n in gather) == batch_bytes(batch)
    # A contiguous batch (one long range) is rows too: every batch moves by the same captured launch.
    rows = copy_rows([(0x40000, 0, 200 * KIB)], 0x7F00_0000, gather=True, row=64 * KIB).tolist()
    assert [n for *_, n in rows] == [64 * KIB] * 3 + [8 * KIB] and rows[3][:2] == [0x40000 + 192 * KIB, 0x7F00_0000 + 192 * KIB]


def test_a_batch_ends_where_its_rows_fill_the_captured_launch():
    # 1 KiB ranges: 4 rows end a batch long before its bytes would; a range longer than a row counts each of its rows.
    small = [(0x1000 * (b + 1), KIB) for b in range(10)]
    batches = packed(small, 1024 * KIB, max_rows=4, row=64 * KIB)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [(a, n) for b in batches for a, _, n in b] == small
    assert packed([(0, 300 * KIB)], 1024 * KIB, max_rows=2, row=64 * KIB) == [
        [(0, 0, 128 * KIB)], [(128 * KIB, 0, 128 * KIB)], [(256 * KIB, 0, 44 * KIB)]]
    for batch in packed([(0x10000, 100 * KIB), *small], 1024 * KIB, max_rows=3, row=64 * KIB):
        assert len(copy_rows(batch, 0, gather=True, row=64 * KIB)) <= 3


def test_the_kernel_takes_only_16_byte_aligned_batches():
    assert kernel_fits([(0x1000, 0, 64 * KIB), (0x40010, 64 * KIB, 32)])
    assert not kernel_fits([(0x1008, 0, 64)])  # address
    assert not kernel_fits([(0x1000, 0, 24)])  # length
    assert not kernel_fits([(0x1000, 0, 40), (0x2000, 40, 16)])  # offset of the second range

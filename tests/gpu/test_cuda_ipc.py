"""CUDA IPC transport on real GPUs: D's regions opened in P, bytes verified, bounds enforced.

Runs only where CUDA GPUs exist (marker `gpu`); CI has none and skips it.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytestmark = pytest.mark.gpu

LAYERS, BLOCKS, BLOCK_LEN = 4, 64, 64 * 1024


def _decode_side(conn, device: int) -> None:
    import torch

    from pdkv.transport.cuda_ipc import CudaIpcTransport

    with CudaIpcTransport(device) as t:
        kv = [torch.zeros(BLOCKS * BLOCK_LEN, dtype=torch.uint8, device=f"cuda:{device}") for _ in range(LAYERS)]
        t.register([(x.data_ptr(), x.numel()) for x in kv])
        conn.send((t.export(), [x.data_ptr() for x in kv]))
        while (msg := conn.recv()) != "stop":
            blocks = msg
            torch.cuda.synchronize(device)
            conn.send([int(x.view(BLOCKS, BLOCK_LEN)[blocks].to(torch.int64).sum()) for x in kv])


def _devices():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    n = torch.cuda.device_count()
    return 0, 1 if n > 1 else 0


def test_ipc_write_lands_exactly_and_refuses_out_of_range():
    import torch

    from pdkv.errors import TransferError
    from pdkv.transport import Descriptor, plan_descriptors
    from pdkv.transport.cuda_ipc import CudaIpcTransport
    from pdkv.wire import Region

    p_dev, d_dev = _devices()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child, d_dev), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "decode side did not export in time"
        export, remote_bases = parent.recv()
        with CudaIpcTransport(p_dev) as t:
            gen = torch.Generator(device=f"cuda:{p_dev}").manual_seed(0)
            src = [
                torch.randint(0, 256, (BLOCKS * BLOCK_LEN,), dtype=torch.uint8, device=f"cuda:{p_dev}", generator=gen)
                for _ in range(LAYERS)
            ]
            t.register([(x.data_ptr(), x.numel()) for x in src])
            t.connect("d", export)
            local = [Region(x.data_ptr(), BLOCK_LEN, BLOCKS) for x in src]
            remote = [Region(b, BLOCK_LEN, BLOCKS) for b in remote_bases]
            for lblocks, rblocks, coalesce in (
                (list(range(10)), list(range(10)), True),
                ([3, 9, 4, 20], [50, 1, 7, 33], False),
            ):
                t.write("d", plan_descriptors(lblocks, rblocks, local, remote, coalesce=coalesce))
                parent.send(rblocks)
                got = parent.recv()
                want = [int(x.view(BLOCKS, BLOCK_LEN)[lblocks].to(torch.int64).sum()) for x in src]
                assert got == want
            # The block kernel path: scattered blocks, then the same bytes are checked.
            lblocks, rblocks = [5, 6, 40, 2], [60, 61, 8, 30]
            assert t.write_blocks("d", lblocks, rblocks, local, remote).bytes == LAYERS * 4 * BLOCK_LEN
            parent.send(rblocks)
            assert parent.recv() == [int(x.view(BLOCKS, BLOCK_LEN)[lblocks].to(torch.int64).sum()) for x in src]
            with pytest.raises(TransferError, match="outside"):
                t.write("d", [Descriptor(src[0].data_ptr(), remote_bases[0] + BLOCKS * BLOCK_LEN - 16, 32)])
            with pytest.raises(TransferError, match="outside"):
                t.write_blocks("d", [0], [BLOCKS], local, remote)
            # A region that claims more blocks than D exported is refused too.
            with pytest.raises(TransferError, match="outside"):
                t.write_blocks("d", [0], [0], local, [Region(remote_bases[0], BLOCK_LEN, BLOCKS + 1)] + remote[1:])
    finally:
        parent.send("stop")
        proc.join(30)


def test_a_captured_block_graph_keeps_the_table_it_reads_from() -> None:
    """The block graph's device table lives as long as the graph: tensors allocated after capture stay untouched.

    Freed after capture, the table's memory went to the next allocation of its size, and every replay wrote block
    ids into it (in a serving engine: P's own tensors, until a device-side assert killed it).
    """
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from pdkv.transport.cuda_ipc import GRAPH_BLOCK_STEP, CudaIpcTransport

    regions, blocks, block_len = 2, GRAPH_BLOCK_STEP, 4096
    with CudaIpcTransport(0) as t:
        graph = t._block_graph(0, regions, blocks, block_len)
        words = 2 * regions + 2 * blocks  # the table's size: the allocation the freed table would have gone to
        bystanders = [torch.full((words,), -7, dtype=torch.int64, device="cuda:0") for _ in range(64)]
        src = torch.randint(0, 256, (regions * blocks * block_len,), dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros_like(src)
        span = blocks * block_len
        bases = [src.data_ptr() + r * span for r in range(regions)] + [dst.data_ptr() + r * span for r in range(regions)]
        ids = np.arange(blocks, dtype=np.int64)
        graph.host.numpy()[:] = np.concatenate([np.array(bases, dtype=np.int64), ids, ids[::-1]])
        t._run(0, graph.graph.replay)
        torch.cuda.synchronize(0)
        assert all(bool((b == -7).all()) for b in bystanders), "a replay wrote into memory allocated after capture"
        want = src.view(regions, blocks, block_len).flip(1)
        assert torch.equal(dst.view(regions, blocks, block_len), want)


def _vmm_decode_side(conn, device: int) -> None:
    """D whose KV is CUDA VMM memory exportable as file descriptors, as vLLM 0.34 allocates it under EXPORTS_FD: each
    layer's segment three allocations mapped back to back (2 MiB each), its blocks spanning the first two, as a
    segment grown after warm-up is."""
    import ctypes

    import numpy as np

    from pdkv.transport.cuda_ipc import CudaIpcTransport

    with CudaIpcTransport(device) as t:
        vmm = t.driver.vmm()
        kv = [vmm.allocate(BLOCKS * BLOCK_LEN, device, chunks=3) for _ in range(LAYERS)]
        for seg in kv:
            t.driver.lib.cuMemsetD8_v2(ctypes.c_uint64(seg.ptr), ctypes.c_ubyte(0), ctypes.c_size_t(seg.size))
        t.register([(seg.ptr, BLOCKS * BLOCK_LEN) for seg in kv])
        conn.send((t.export(), [seg.ptr for seg in kv]))
        while (msg := conn.recv()) != "stop":
            sums = []
            for seg in kv:
                host = np.zeros(BLOCKS * BLOCK_LEN, dtype=np.uint8)
                t.driver.lib.cuMemcpyDtoH_v2(host.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(seg.ptr), ctypes.c_size_t(host.nbytes))
                sums.append(int(host.reshape(BLOCKS, BLOCK_LEN)[msg].astype(np.int64).sum()))
            conn.send(sums)
        for seg in kv:
            vmm.unmap(seg)


def test_ipc_writes_into_vmm_memory_shared_by_file_descriptor():
    """vLLM 0.34's extensible KV cache: D's allocations go to P as descriptors (fd_share), P maps those back to back
    in D back to back and writes blocks on both sides of a boundary between two; a forged token gets nothing."""
    import msgspec
    import torch

    from pdkv.errors import TransferError
    from pdkv.wire import Region
    from pdkv.transport.cuda_ipc import CudaIpcTransport

    p_dev, d_dev = _devices()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_vmm_decode_side, args=(child, d_dev), daemon=True)
    proc.start()
    try:
        assert parent.poll(120), "decode side did not export in time"
        export, remote_bases = parent.recv()
        assert all(a.fd and a.handle == b"" for a in export.allocations) and export.fd_server and len(export.fd_token) == 32
        assert len(export.allocations) == 2 * LAYERS, [(hex(a.base), a.size) for a in export.allocations]
        with CudaIpcTransport(p_dev) as t:
            forged = msgspec.structs.replace(export, fd_token=bytes(32))
            with pytest.raises(TransferError, match="refused"):
                t.connect("d", forged)
            gen = torch.Generator(device=f"cuda:{p_dev}").manual_seed(1)
            src = [torch.randint(0, 256, (BLOCKS * BLOCK_LEN,), dtype=torch.uint8, device=f"cuda:{p_dev}", generator=gen)
                   for _ in range(LAYERS)]
            t.register([(x.data_ptr(), x.numel()) for x in src])
            t.connect("d", export)
            local = [Region(x.data_ptr(), BLOCK_LEN, BLOCKS) for x in src]
            remote = [Region(b, BLOCK_LEN, BLOCKS) for b in remote_bases]
            lblocks, rblocks = [5, 6, 40, 2], [31, 32, 8, 60]  # 31 | 32: either side of the first boundary
            assert t.write_blocks("d", lblocks, rblocks, local, remote).bytes == LAYERS * 4 * BLOCK_LEN
            parent.send(rblocks)
            assert parent.recv() == [int(x.view(BLOCKS, BLOCK_LEN)[lblocks].to(torch.int64).sum()) for x in src]
            with pytest.raises(TransferError):
                t.write_blocks("d", [0], [BLOCKS], local, remote)  # past D's exported blocks
            t.disconnect("d")  # unmaps the imported allocations
    finally:
        parent.send("stop")
        proc.join(timeout=30)

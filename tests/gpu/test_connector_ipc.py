"""pdkv's connector worker side over CUDA IPC on real GPUs: P (cuda:0, this process) pushes into D (cuda:1, a child).

No vLLM: the scheduler's news is applied by hand, as the connector's hooks would.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

pytestmark = pytest.mark.gpu

LAYERS, BLOCKS, BLOCK_LEN = 3, 16, 4096
ENGINE = "engine-p"


def _decode(conn, bootstrap_url: str) -> None:
    import torch

    from pdkv.connector.receiver import KVReceiver, PullSpec
    from pdkv.transport.base import Region
    from pdkv.transport.cuda_ipc import CudaIpcTransport

    device = 1 if torch.cuda.device_count() > 1 else 0
    with CudaIpcTransport(device) as t:
        mem = torch.zeros((LAYERS, BLOCKS, BLOCK_LEN), dtype=torch.uint8, device=f"cuda:{device}")
        base = mem.data_ptr()
        regions = [Region(base + i * BLOCKS * BLOCK_LEN, BLOCK_LEN, BLOCKS) for i in range(LAYERS)]
        t.register([(base, mem.numel())])
        with KVReceiver(t.session_address, regions, liveness_s=5.0, ipc=t.export()) as rx:
            conn.send("ready")
            blocks = conn.recv()
            rx.apply_step(pulls=[PullSpec("d1", "x1", bootstrap_url, ENGINE, blocks)])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                res = rx.take_results()
                if "d1" in res.finished:
                    break
                time.sleep(0.01)
            torch.cuda.synchronize(device)
            conn.send((dict(res.failed), mem.cpu().numpy()))


def test_p_pushes_over_cuda_ipc_into_a_decode_process():
    import torch

    from pdkv.bootstrap.client import BootstrapClient
    from pdkv.bootstrap.server import start_background
    from pdkv.connector.sender import KVSender
    from pdkv.protocol import RegisterRequest
    from pdkv.transport.base import Region
    from pdkv.transport.cuda_ipc import CudaIpcTransport

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with start_background("127.0.0.1", 0) as bs, CudaIpcTransport(0) as t:
        src = torch.randint(0, 256, (LAYERS, BLOCKS, BLOCK_LEN), dtype=torch.uint8, device="cuda:0")
        base = src.data_ptr()
        t.register([(base, src.numel())])
        regions = [Region(base + i * BLOCKS * BLOCK_LEN, BLOCK_LEN, BLOCKS) for i in range(LAYERS)]
        with KVSender(t, regions, host="127.0.0.1", engine_id=ENGINE, heartbeat_s=0.2) as sender:
            with BootstrapClient(bs.url) as c:
                c.register(RegisterRequest(engine_id=ENGINE, dp_rank=0, tp_rank=0, pp_rank=0, addr=sender.address))
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_decode, args=(child, bs.url), daemon=True)
            proc.start()
            try:
                assert parent.poll(120) and parent.recv() == "ready"
                p_blocks, d_blocks = [2, 3, 4, 9], [5, 6, 7, 12]
                sender.apply_step(registered={"p1": "x1"}, ready={"p1": ("x1", p_blocks)})
                parent.send(d_blocks)
                assert parent.poll(60)
                failed, got = parent.recv()
                assert failed == {}
                want = src.cpu().numpy()
                for layer in range(LAYERS):
                    for pb, db in zip(p_blocks, d_blocks, strict=True):
                        assert (got[layer, db] == want[layer, pb]).all()
                    untouched = [b for b in range(BLOCKS) if b not in d_blocks]
                    assert not got[layer, untouched].any()
                trace = sender.trace.get("x1")
                assert trace is not None and trace.status == "sent" and trace.bytes == 4 * LAYERS * BLOCK_LEN
            finally:
                proc.join(30)

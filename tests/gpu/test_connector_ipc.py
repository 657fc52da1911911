"""pdkv's connector worker side over CUDA IPC on real GPUs: P (cuda:0, this process) pushes into D (cuda:1, a child).

No vLLM: the scheduler's news is applied by hand, as the connector's hooks would.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytestmark = pytest.mark.gpu

LAYERS, BLOCKS, BLOCK_LEN = 3, 16, 4096
ENGINE = "engine-p"


def _decode(conn, bootstrap_url: str) -> None:
    import torch
    from support.kv_pair import wait_results

    from pdkv.connector.receiver import KVReceiver, PullSpec
    from pdkv.wire import Region
    from pdkv.transport.cuda_ipc import CudaIpcTransport

    device = 1 if torch.cuda.device_count() > 1 else 0
    with CudaIpcTransport(device) as t:
        mem = torch.zeros((LAYERS, BLOCKS, BLOCK_LEN), dtype=torch.uint8, device=f"cuda:{device}")
        base = mem.data_ptr()
        regions = [Region(base + i * BLOCKS * BLOCK_LEN, BLOCK_LEN, BLOCKS) for i in range(LAYERS)]
        t.register([(base, mem.numel())])
        with KVReceiver(t.session_address, regions, liveness_s=5.0, ipc=t.export()) as rx:
            conn.send("ready")
            while (job := conn.recv()) is not None:  # (d_req_id, transfer_id, blocks), one pull at a time
                d_req, tid, blocks = job
                rx.apply_step(pulls=[PullSpec(d_req, tid, bootstrap_url, ENGINE, blocks)])
                res = wait_results(rx, {d_req}, timeout=30)
                torch.cuda.synchronize(device)
                conn.send((dict(res.failed), mem.cpu().numpy()))


@pytest.mark.parametrize("when", ["finished", "computed"])
def test_p_pushes_over_cuda_ipc_into_a_decode_process(when):
    import torch
    from support.kv_pair import register, settle, wait_freed, wait_parked
    from support.waiting import wait_for

    from pdkv.bootstrap import start_background
    from pdkv.connector.sender import KVSender
    from pdkv.wire import Region
    from pdkv.transport.cuda_ipc import CudaIpcTransport

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with start_background("127.0.0.1", 0) as bs, CudaIpcTransport(0) as t:
        src = torch.randint(0, 256, (LAYERS, BLOCKS, BLOCK_LEN), dtype=torch.uint8, device="cuda:0")
        final = src.clone()
        base = src.data_ptr()
        t.register([(base, src.numel())])
        regions = [Region(base + i * BLOCKS * BLOCK_LEN, BLOCK_LEN, BLOCKS) for i in range(LAYERS)]
        with KVSender(t, regions, host="127.0.0.1", engine_id=ENGINE, heartbeat_s=0.2) as sender:
            register(bs.url, sender, ENGINE)
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_decode, args=(child, bs.url), daemon=True)
            proc.start()
            try:
                assert parent.poll(120) and parent.recv() == "ready"
                p_blocks, d_blocks = [2, 3, 4, 9], [5, 6, 7, 12]
                # A first transfer of the same shape: handles opened and the copy graph captured (both synchronize the device).
                sender.apply_step(registered={"p0": "x0"}, ready={"p0": ("x0", p_blocks)})
                parent.send(("d0", "x0", d_blocks))
                assert parent.poll(60) and parent.recv()[0] == {}
                wait_freed(sender, {"p0"})  # the warm-up transfer's blocks
                sender.apply_step(registered={"p1": "x1"})
                parent.send(("d1", "x1", d_blocks))
                if when == "finished":
                    sender.apply_step(ready={"p1": ("x1", p_blocks)})
                else:
                    # A "forward" still running on the GPU writes the prompt's KV: the write must wait for it.
                    wait_parked(sender, "x1", timeout=30)
                    src.zero_()
                    torch.cuda.synchronize()
                    forward = torch.cuda.Stream()  # as vLLM's, not the stream the copy is issued on
                    with torch.cuda.stream(forward):
                        torch.cuda._sleep(200_000_000)
                        src.copy_(final)
                        fence = torch.cuda.Event()
                        fence.record()
                    sender.prompt_done({"p1": ("x1", p_blocks)}, fence)
                    wait_for(lambda: sender.trace.get("x1").status == "sent", 30, "P to conclude the write after the fence")
                    settle(sender)
                    assert "p1" not in sender.take_finished()  # not freed before P's request finishes
                    sender.apply_step(ready={"p1": ("x1", p_blocks)})
                assert parent.poll(60)
                failed, got = parent.recv()
                assert failed == {}
                want = final.cpu().numpy()
                for layer in range(LAYERS):
                    for pb, db in zip(p_blocks, d_blocks, strict=True):
                        assert (got[layer, db] == want[layer, pb]).all()
                    untouched = [b for b in range(BLOCKS) if b not in d_blocks]
                    assert not got[layer, untouched].any()
                trace = sender.trace.get("x1")
                assert trace is not None and trace.status == "sent" and trace.bytes == 4 * LAYERS * BLOCK_LEN
            finally:
                parent.send(None)
                proc.join(30)

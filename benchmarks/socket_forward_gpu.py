"""What P's forward loses to a socket write running beside it, on one GPU that P and D share (the lent GPU host).

A forward shaped like Qwen3-8B's prefill of 1,000 tokens (36 layers of bf16 projections, attention and MLP, launched
from Python one layer at a time, an event recorded after each layer) runs in P's process; the seed's 63 blocks
(141.75 MiB, 36 layer regions, scattered as `pdkv bench` lays them out) go to a D process on the same GPU through the
socket transport, cut into --groups writes, each begun once its layers' events have completed (what
`socket_layer_groups` does in the connector). Modes, in one run, each a median of --iters forwards:

    alone       the forward, nothing beside it
    after       the forward, then one write (the connector's default): its time is the handover's write
    layers      the writes during the forward, D's KV on the GPU (what `pdkv-socket-layers` does)
    layers-dh   the same, D's KV in host memory: D's process does no GPU work
    d-gpu       no write: D's process does its staging's GPU work (the scatter of 8 MiB batches out of a pinned
                buffer) for as long as the forward runs
    d-copy      the same, 8 MiB host-to-GPU copies instead (the copy engines, no kernel of D's)
    p-host      the writes during the forward from P's host memory to D's host memory: the write's CPU and
                interpreter work beside the forward, no GPU copy at all
    proc-gpu    `layers` with P's send process (`socket_send_process`): P's thread waits for each group's event
                and hands the write to the child, which reads P's KV through CUDA IPC and sends it
    proc-gpu-dh proc-gpu with D's KV in host memory: what the send process's own GPU work costs P's forward
    proc-host   p-host with the sends out of P's interpreter: a process of the benchmark's own sends a host-memory
                copy of the KV, told over a pipe once P's thread saw each group's event

`forward_ms` is the forward's time on the GPU (events around it), `tail_ms` how long after the forward ended on the
GPU the last write landed, `cpu_ms` how long the thread launching the forward took to launch it, `landing_ms` one
pinned-to-GPU copy of all the transfer's bytes. vLLM's eager prefill spends Python between its launches (on an H100,
28.6 ms of CPU for Qwen3-8B's 36 layers, the GPU done 5 ms after): `--layer-cpu-ms` (default 0.75) of pure Python in
each layer, in four stretches between its launches, makes this forward as bound by its thread as vLLM's, so that the
interpreter's lock taken by the writes' threads shows in `forward_ms` as it does in vLLM's prefill (0: the bare
launches, far ahead of the GPU).

What the forward loses in `layers` but not in `layers-dh` is D's GPU work (two processes' work on one GPU takes
turns), and `d-gpu` and `d-copy` say so without a write; what it loses in `layers-dh` but not in `p-host` is P's
staging, its threads' calls that release the interpreter's lock (docs/socket.md).

Every thread that wakes from a blocking call (a lane's event wait, send or acknowledgement) must take the interpreter's
lock back from the model runner's thread, which drops it in every torch call: fewer connections (--connections) or
groups mean fewer such wake-ups during the forward, and more of the write after it.

Run (a GPU host, torch with CUDA): python benchmarks/socket_forward_gpu.py [--groups 6] [--connections 4] [--modes alone,layers]
     [--iters 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdkv.connector.config import ConnectorConfig  # noqa: E402  (after the checkout is on the path)
from pdkv.transport.sockets.staging import DEFAULT_CHUNK_BYTES  # noqa: E402
from pdkv.transport.sockets.transport import DEFAULT_BUFFER_BYTES  # noqa: E402

LAYERS, BLOCK_BYTES, BLOCKS, TOKENS = 36, 64 << 10, 63, 1000
HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 12288
TRANSFER = "socket-forward"
MODES = ("alone", "after", "layers", "layers-dh", "d-gpu", "d-copy", "p-host", "proc-gpu", "proc-gpu-dh", "proc-host")
SEND_PROCESS = ("proc-gpu", "proc-gpu-dh")  # P's transport with its send process
LOADS = {"d-gpu": "scatter", "d-copy": "copy"}  # what D's process does beside the forward


def _kv(num_blocks: int, on_gpu: bool) -> list:
    import torch

    return [torch.zeros(BLOCK_BYTES * num_blocks, dtype=torch.uint8, device="cuda:0" if on_gpu else "cpu") for _ in range(LAYERS)]


def decode_main(args: argparse.Namespace) -> None:
    """D: its KV on the GPU or in host memory, registered and granted; prints its session and bases, then answers
    `load WHAT` (GPU work in a loop: the staging's scatter, or copies), `idle` and `stop` on stdin."""
    import torch

    from pdkv.transport.sockets import SocketTransport
    from pdkv.transport.sockets.staging import CudaStaging, packed

    on_gpu = args.d_memory == "gpu"
    kv = _kv(args.num_blocks, on_gpu)
    spans = [(int(t.data_ptr()), t.numel()) for t in kv]
    stop = threading.Event()

    def load(what: str) -> None:  # a diagnostic reaches into the staging: its scatter, without a socket
        staging = CudaStaging(0)
        dev = torch.empty(staging.chunk, dtype=torch.uint8, device="cuda:0")
        ranges = [(a + k * 3 * BLOCK_BYTES, BLOCK_BYTES) for a, _ in spans for k in range(args.num_blocks // 3)]
        batches = packed(ranges, staging.chunk)
        while not stop.is_set():
            for i, batch in enumerate(batches):
                if what == "copy":
                    dev.copy_(staging._buffers[i % 2], non_blocking=True)
                    torch.cuda.current_stream().synchronize()
                else:
                    staging._stage(i, batch, gather=False)
                    staging._events[i % 2].synchronize()
        staging.close()

    with SocketTransport("127.0.0.1", gpu=0 if on_gpu else None, staging=args.staging, chunk_bytes=args.chunk_mib << 20,
                         buffer_bytes=args.socket_buffer) as d:
        d.register(spans)
        d.expect(TRANSFER, spans)
        print(json.dumps({"session": d.session_address, "bases": [a for a, _ in spans]}), flush=True)
        worker = None
        for line in sys.stdin:
            if line.startswith("load"):
                stop.clear()
                worker = threading.Thread(target=load, args=(line.split()[1],), daemon=True)
                worker.start()
            elif line.startswith("idle") and worker is not None:
                stop.set()
                worker.join()
            elif line.startswith("stop"):
                return
            print("ok", flush=True)


def sender_main(args: argparse.Namespace) -> None:
    """proc-host's sends out of P's interpreter: KV of the same shape in host memory written to D a group of layers
    at a time, `write BEGIN END` on stdin answered `ok` once the group landed; `stop` ends it."""
    from pdkv.bench.layout import block_ids
    from pdkv.transport.base import Region
    from pdkv.transport.sockets import SocketTransport

    kv = _kv(args.num_blocks, False)
    local = [Region(int(t.data_ptr()), BLOCK_BYTES, args.num_blocks) for t in kv]
    target = json.loads(args.target)
    remote = [Region(a, BLOCK_BYTES, args.num_blocks) for a in target["bases"]]
    src, dst = block_ids("scattered", BLOCKS)
    with SocketTransport(writable=False, connections=args.connections) as p:
        p.register([(r.base, BLOCK_BYTES * args.num_blocks) for r in local])
        print("ready", flush=True)
        for line in sys.stdin:
            if line.startswith("stop"):
                return
            _, begin, end = line.split()
            b, e = int(begin), int(end)
            p.write_blocks(target["session"], src, dst, local[b:e], remote[b:e], transfer=TRANSFER)
            print("ok", flush=True)


class Forward:
    """Qwen3-8B's layer shapes for TOKENS tokens, one set of weights for every layer; an event after each layer."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        g = torch.Generator(device="cuda:0").manual_seed(0)

        def w(*shape: int):
            return torch.randn(*shape, device="cuda:0", dtype=torch.bfloat16, generator=g) * 0.02

        self.qkv = w(HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.o = w(Q_HEADS * HEAD_DIM, HIDDEN)
        self.up = w(HIDDEN, 2 * FFN)
        self.down = w(FFN, HIDDEN)
        self.x0 = w(TOKENS, HIDDEN)

    def run(self, events: list, recorded: list[threading.Event], cpu_ms: float) -> float:
        """Launch the forward, `cpu_ms` of Python in each layer; wait for it; return the launching's time (ms)."""
        torch, F = self.torch, self.torch.nn.functional
        x = self.x0
        stretch = cpu_ms / 4e3
        began = time.perf_counter()
        for layer in range(LAYERS):
            _python(stretch)
            h = F.rms_norm(x, (HIDDEN,))
            q, k, v = (h @ self.qkv).split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            q = q.view(TOKENS, Q_HEADS, HEAD_DIM).transpose(0, 1)
            k = k.view(TOKENS, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, 0)
            v = v.view(TOKENS, KV_HEADS, HEAD_DIM).transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, 0)
            _python(stretch)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(TOKENS, -1)
            x = x + a @ self.o
            _python(stretch)
            gate, up = (F.rms_norm(x, (HIDDEN,)) @ self.up).chunk(2, dim=-1)
            _python(stretch)
            x = x + (F.silu(gate) * up) @ self.down
            events[layer].record()
            recorded[layer].set()
        launched = time.perf_counter()
        torch.cuda.current_stream().synchronize()
        return (launched - began) * 1e3


def _measure(mode: str, fwd: Forward, args: argparse.Namespace) -> dict:
    """One mode's medians: a D process of its own, the forwards with (or without, or after them) the writes."""
    import torch

    from pdkv.bench.layout import block_ids, blocks_needed
    from pdkv.connector.layer_writes import group_ends
    from pdkv.transport.base import Region
    from pdkv.transport.sockets import SocketTransport

    num_blocks = blocks_needed("scattered", BLOCKS)
    src, dst = block_ids("scattered", BLOCKS)
    p_gpu = mode not in ("p-host", "proc-host")
    d_memory = "gpu" if mode in ("after", "layers", "proc-gpu", *LOADS) else "host"
    kv = _kv(num_blocks, p_gpu)
    local = [Region(int(t.data_ptr()), BLOCK_BYTES, num_blocks) for t in kv]
    argv = [sys.executable, __file__, "--role", "d", "--d-memory", d_memory, "--num-blocks", str(num_blocks),
            "--chunk-mib", str(args.chunk_mib), "--socket-buffer", str(args.socket_buffer),
            "--switch-us", str(args.switch_us), *(["--staging", args.staging] if args.staging else [])]
    d = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert d.stdin is not None and d.stdout is not None
    d_in, d_out = d.stdin, d.stdout

    def tell(line: str) -> None:
        d_in.write(line + "\n")
        d_in.flush()
        if line != "stop" and d_out.readline().strip() != "ok":
            raise RuntimeError(f"D did not answer {line!r}")

    ready = json.loads(d_out.readline())
    remote = [Region(a, BLOCK_BYTES, num_blocks) for a in ready["bases"]]
    sender = None
    if mode == "proc-host":
        sender = subprocess.Popen(
            [sys.executable, __file__, "--role", "s", "--num-blocks", str(num_blocks),
             "--switch-us", str(args.switch_us), "--connections", str(args.connections), "--target", json.dumps(ready)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert sender.stdin is not None and sender.stdout is not None
        if sender.stdout.readline().strip() != "ready":
            raise RuntimeError("the sender process did not start")
    ends = group_ends(LAYERS, 1 if mode == "after" else args.groups)
    if args.tail_layers and mode != "after" and args.groups > 1:  # the last group only the last few layers
        ends = [*group_ends(LAYERS - args.tail_layers, args.groups - 1), LAYERS]
    forward_ms, tail_ms, cpu_ms = [], [], []
    try:
        with SocketTransport(writable=False, gpu=0 if p_gpu else None, connections=args.connections, staging=args.staging,
                             chunk_bytes=args.chunk_mib << 20, buffer_bytes=args.socket_buffer,
                             send_process=mode in SEND_PROCESS) as p:
            p.register([(r.base, BLOCK_BYTES * num_blocks) for r in local])
            if mode in SEND_PROCESS and (state := p.await_send_process(60)) != "ready":
                raise RuntimeError(f"P's send process did not start: {state}")

            def writes(events: list, recorded: list[threading.Event], landed: list[float]) -> None:
                begin = 0
                for end in ends:
                    if not recorded[end - 1].wait(timeout=60):
                        raise TimeoutError(f"layer {end - 1} was never computed")
                    events[end - 1].synchronize()
                    if sender is not None:
                        assert sender.stdin is not None and sender.stdout is not None
                        sender.stdin.write(f"write {begin} {end}\n")
                        sender.stdin.flush()
                        if sender.stdout.readline().strip() != "ok":
                            raise RuntimeError("the sender process failed a write")
                    else:
                        p.write_blocks(ready["session"], src, dst, local[begin:end], remote[begin:end], transfer=TRANSFER)
                    begin = end
                landed.append(time.perf_counter())

            for _ in range(3 if mode != "alone" and mode not in LOADS else 0):  # connections, staging buffers, kernels
                writes([_Done()] * LAYERS, [_set()] * LAYERS, [])
            if mode in LOADS:
                tell(f"load {LOADS[mode]}")
            for i in range(args.warmup + args.iters):
                events = [torch.cuda.Event(enable_timing=True) for _ in range(LAYERS)]
                recorded = [threading.Event() for _ in range(LAYERS)]
                start = torch.cuda.Event(enable_timing=True)
                landed: list[float] = []
                beside = mode in ("layers", "layers-dh", "p-host", "proc-host", *SEND_PROCESS)
                writer = threading.Thread(target=writes, args=(events, recorded, landed)) if beside else None
                start.record()
                if writer is not None:
                    writer.start()
                launching = fwd.run(events, recorded, args.layer_cpu_ms)
                done = time.perf_counter()
                if mode == "after":
                    writes(events, recorded, landed)
                if writer is not None:
                    writer.join(timeout=60)
                    if not landed:
                        raise RuntimeError(f"{mode}: the writes did not finish")
                if i >= args.warmup:
                    forward_ms.append(start.elapsed_time(events[-1]))
                    cpu_ms.append(launching)
                    if landed:
                        tail_ms.append((landed[0] - done) * 1e3)
            if mode in LOADS:
                tell("idle")
    finally:
        if sender is not None and sender.stdin is not None:
            sender.stdin.write("stop\n")
            sender.stdin.close()
            sender.wait(timeout=30)
        tell("stop")
        d.wait(timeout=30)
    return {"forward_ms": statistics.median(forward_ms), "cpu_ms": statistics.median(cpu_ms),
            "tail_ms": statistics.median(tail_ms) if tail_ms else None}


def prefill_main(args: argparse.Namespace) -> None:
    fwd = Forward()
    results: dict[str, dict] = {}
    for mode in ["alone", *(m for m in args.modes.split(",") if m != "alone")]:
        results[mode] = _measure(mode, fwd, args)
        print(json.dumps({"mode": mode, **results[mode]}), flush=True)
    alone = results["alone"]["forward_ms"]
    print(f"{'mode':10} {'forward':>9} {'lost':>8} {'launch':>9} {'tail':>9}")
    for mode, r in results.items():
        tail = f"{r['tail_ms']:7.2f}ms" if r["tail_ms"] is not None else "        -"
        print(f"{mode:10} {r['forward_ms']:7.2f}ms {r['forward_ms'] - alone:6.2f}ms {r['cpu_ms']:7.2f}ms {tail}")
    landing = _landing_ms(args.iters)
    print(f"the transfer's bytes in one pinned-to-GPU copy: {landing:.2f} ms (what D would add after the last group if it "
          f"kept a write in host memory until then, as in layers-dh)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"groups": args.groups, "tail_layers": args.tail_layers, "chunk_mib": args.chunk_mib,
             "socket_buffer": args.socket_buffer, "connections": args.connections,
             "layer_cpu_ms": args.layer_cpu_ms, "switch_us": args.switch_us,
             "iters": args.iters,
             "modes": results, "landing_ms": landing},
            indent=1,
        ))


def _landing_ms(iters: int) -> float:
    """Median time of one copy of the seed's bytes (63 blocks x 36 layers) from pinned host memory to the GPU."""
    import torch

    nbytes = BLOCKS * LAYERS * BLOCK_BYTES
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def _python(seconds: float) -> None:
    """Pure Python for `seconds`, holding the interpreter's lock as vLLM's own code between its launches does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _set() -> threading.Event:
    e = threading.Event()
    e.set()
    return e


class _Done:
    """An event already complete: the warm-up writes wait for nothing."""

    def synchronize(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("p", "d", "s"), default="p")
    ap.add_argument("--d-memory", choices=("gpu", "host"), default="gpu")
    ap.add_argument("--target", default="", help="the sender process's D: its session and bases (JSON)")
    ap.add_argument("--num-blocks", type=int, default=0)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--tail-layers", type=int, default=0,
                    help="the last group holds only the last N layers, the others are cut evenly (0: all even)")
    ap.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES >> 20, help="each staging buffer, P's and D's (MiB)")
    ap.add_argument("--socket-buffer", type=int, default=DEFAULT_BUFFER_BYTES,
                    help="each connection's socket buffers, P's and D's (bytes; 0: the kernel's autotuning)")
    ap.add_argument("--connections", type=int, default=0, help="P's connections to D (0: the transport's default)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"any of {','.join(MODES)} (alone always runs)")
    ap.add_argument("--layer-cpu-ms", type=float, default=0.75, help="pure Python in each layer's launching (0: none)")
    ap.add_argument("--switch-us", type=int, default=ConnectorConfig().switch_interval_us,
                    help="the interpreter's switch interval in P and D, as the connector sets it in an engine's worker "
                         "(switch_interval_us); 0: Python's own 5,000 us")
    ap.add_argument("--staging", choices=("kernel", "copies"), default=None,
                    help="the GPU staging of P, D and the send process: the copy kernel, or the copy engines, a copy a "
                         "range (default: the transport's: the kernel in P's process, the copy engines elsewhere)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if unknown := set(args.modes.split(",")) - set(MODES):
        ap.error(f"unknown modes {sorted(unknown)}: any of {','.join(MODES)}")
    if args.switch_us:
        sys.setswitchinterval(args.switch_us / 1e6)

    {"d": decode_main, "s": sender_main, "p": prefill_main}[args.role](args)


if __name__ == "__main__":
    main()

"""`pdkv bench`: KV transfer measured exactly as the connector performs it, over pdkv's transport and planner.

P's side (this process) allocates per-layer KV regions shaped like the model's, registers them, asks D's side (a
BenchTarget: a child process by default, or `pdkv bench serve` on another host) for its regions, plans the descriptors
per layout, and times `Transport.write`. Every case verifies the bytes that arrived against the source (BLAKE2b of the
transferred ranges on both sides) after the cold transfer and again after the timed ones.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

from pdkv.bench.layout import Timing, block_ids, blocks_needed, case_plan_bytes, coalesces, expand_layouts, summarize, tp_layout
from pdkv.errors import PdkvError, StartError, TransferError, UsageError
from pdkv.geometry import KVGeometry
from pdkv.transport import TRANSPORTS, Descriptor, plan_descriptors

log = logging.getLogger(__name__)

DEFAULT_LINK_GBPS = 400.0
TARGET_START_TIMEOUT_S = 60.0
SEND_PROCESS_START_S = 60.0  # the socket send process's start (imports, a CUDA context), before the first case

Progress = Callable[[str, int, int], None]


class BenchSpec(msgspec.Struct, frozen=True):
    """One `pdkv bench` run: every (blocks, layout) pair is a case."""

    geometry: KVGeometry
    block_size: int = 16
    blocks: list[int] = msgspec.field(default_factory=lambda: [63])
    layouts: list[str] = msgspec.field(default_factory=lambda: ["contiguous"])
    transport: str = "tcp"
    device: str = ""
    hostname: str = "127.0.0.1"
    src: str = "cpu"
    dst: str = "cpu"
    iters: int = 20
    warmup: int = 2
    seed: int = 0
    link_gbps: float | None = None
    baseline: bool = False
    transfer_engine_bench: bool = True
    target: str | None = None
    settings: dict[str, str] = msgspec.field(default_factory=dict)
    tp: tuple[int, int] = (1, 1)  # P's, D's; unequal: D rank 0's heads from each P rank holding them (geometry: whole model)
    connections: int = 0  # transport socket: P's connections to D (0: the transport's default)
    socket_buffer_bytes: int | None = None  # transport socket, both sides (None: the transport's default; 0: autotuning)


class BaselineResult(msgspec.Struct, frozen=True):
    """The same descriptors through bare TransferEngine calls, interleaved with pdkv's iterations."""

    bare: Timing
    p50_ratio: float  # pdkv p50 / bare p50: 1.00 means pdkv adds nothing
    teb_gbps: float | None = None
    teb_ratio: float | None = None  # pdkv GB/s at p50 / transfer_engine_bench GB/s
    teb_note: str | None = None


class CaseResult(msgspec.Struct, frozen=True):
    layout: str
    blocks: int
    bytes: int
    plan_bytes: int
    descriptors: int
    plan_ms: float
    cold_ms: float
    timing: Timing
    verified: bool
    baseline: BaselineResult | None = None
    rank_bytes: dict[str, int] = {}  # P and D of different TP: P rank -> bytes it writes into D rank 0


class BenchReport(msgspec.Struct, frozen=True):
    geometry: KVGeometry
    block_size: int
    block_len: int
    transport: str
    device: str
    src: str
    dst: str
    link_gbps: float
    link_source: str
    target: str
    peer: str
    mc_settings: dict[str, str]
    cases: list[CaseResult]
    note: str | None = None


def link_rate(spec: BenchSpec) -> tuple[float, str]:
    """The link rate to compare against, and where it came from: --link-gbps, the device's sysfs rate, or 400."""
    from pdkv.transport import link_gbps_of

    if spec.link_gbps is not None:
        if spec.link_gbps <= 0:
            raise UsageError(f"--link-gbps must be positive, got {spec.link_gbps}")
        return spec.link_gbps, "--link-gbps"
    if spec.device:
        rate = link_gbps_of(spec.device)
        if rate:
            return rate, f"sysfs {spec.device.split(',')[0]}"
    return DEFAULT_LINK_GBPS, "default"


def check_spec(spec: BenchSpec) -> None:
    if spec.iters <= 0:
        raise UsageError(f"--iters must be positive, got {spec.iters}")
    if spec.warmup < 0:
        raise UsageError(f"--warmup must not be negative, got {spec.warmup}")
    if not spec.blocks or any(n <= 0 for n in spec.blocks):
        raise UsageError("--blocks must be positive")
    expand_layouts(spec.layouts)
    from pdkv.bench.memory import parse_device
    from pdkv.transport import check_mooncake_transport

    if spec.transport not in TRANSPORTS:
        raise UsageError(f"--transport {spec.transport!r} is not one of {', '.join(TRANSPORTS)}")

    src, dst = parse_device(spec.src), parse_device(spec.dst)
    if spec.transport == "ipc":
        if not (src.startswith("cuda:") and dst.startswith("cuda:")):
            raise UsageError("--transport ipc moves KV between GPUs", hint="pass --src cuda:N --dst cuda:M")
        return
    if spec.transport == "socket":
        return
    if spec.transport == "cma":
        if (src, dst) != ("cpu", "cpu"):
            raise UsageError(
                "--transport cma moves host memory between processes of this host",
                hint="use --src cpu --dst cpu, or --transport ipc for GPUs",
            )
        return
    # Before any process starts: a wrong transport or a missing RDMA device fails here, in seconds.
    check_mooncake_transport(spec.transport, spec.device)


def resolve_transport(spec: BenchSpec) -> tuple[BenchSpec, str | None]:
    """For ipc, fall back to Mooncake tcp (with the reason, also logged) when the two GPUs cannot reach each other."""
    if spec.transport != "ipc" or spec.target is not None:
        return spec, None
    from pdkv.transport import ipc_reachable

    ok, reason = ipc_reachable(int(spec.src[5:]), int(spec.dst[5:]))
    if ok:
        return spec, None
    note = f"ipc unavailable ({reason}); fell back to Mooncake tcp"
    log.warning(note)
    return msgspec.structs.replace(spec, transport="tcp"), note


def _local_target_main(conn, transport: str, device: str, dst: str, settings: dict[str, str], buffer_bytes: int | None) -> None:
    from pdkv.bench.control import BenchTarget

    try:
        target = BenchTarget("127.0.0.1", 0, transport=transport, device_name=device, dst=dst, settings=settings,
                             socket_buffer_bytes=buffer_bytes)
    except PdkvError as exc:
        conn.send(("error", exc.message, exc.hint))
        return
    with target:
        conn.send(("ready", target.address, None))
        parent = os.getppid()
        target.serve(once=True, alive=lambda: os.getppid() == parent)


@contextlib.contextmanager
def local_target(spec: BenchSpec, timeout_s: float = TARGET_START_TIMEOUT_S) -> Iterator[str]:
    """Start a BenchTarget in a child process on 127.0.0.1 and yield its control address."""
    ctx = mp.get_context("spawn")  # no fork: CUDA and Mooncake threads do not survive it
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_local_target_main,
        args=(writer, spec.transport, spec.device, spec.dst, dict(spec.settings), spec.socket_buffer_bytes),
        name="pdkv-bench-target",
        daemon=True,
    )
    proc.start()
    writer.close()
    try:
        if not reader.poll(timeout_s):
            raise StartError(f"the local bench target did not start within {timeout_s:g} s")
        try:
            kind, value, hint = reader.recv()
        except EOFError:
            proc.join(5)
            raise StartError(
                f"the local bench target exited (code {proc.exitcode}) before it was ready",
                hint="a script that runs the benchmark through the library needs an `if __name__ == '__main__':` guard",
            ) from None
        if kind != "ready":
            raise StartError(f"the local bench target could not start: {value}", hint=hint)
        yield value
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        reader.close()


def verify_transfer(client, memory, descriptors: list[Descriptor], what: str) -> None:
    """Compare D's bytes over every descriptor's destination with P's source bytes; TransferError on a mismatch."""
    remote = client.checksum([(d.dst, d.length) for d in descriptors])
    local = memory.digest([(d.src, d.length) for d in descriptors])
    if remote != local:
        nbytes = sum(d.length for d in descriptors)
        raise TransferError(
            f"bytes that arrived differ from the source ({what}: {nbytes:,} B in {len(descriptors)} descriptors)",
            hint="the transfer wrote wrong or partial data; rerun with MC_LOG_LEVEL=INFO and check both hosts' memory",
        )


def run_bench(spec: BenchSpec, on_progress: Progress | None = None) -> BenchReport:
    """Run every case of `spec` and return the report; TransferError if any transfer fails or arrives corrupted."""
    check_spec(spec)
    spec, note = resolve_transport(spec)
    link_gbps, link_source = link_rate(spec)
    with contextlib.ExitStack() as stack:
        address = spec.target or stack.enter_context(local_target(spec))
        report = _run(spec, address, link_gbps, link_source, on_progress, stack)
        return msgspec.structs.replace(report, note=note) if note else report
    raise AssertionError("unreachable")  # pragma: no cover


def _run(spec: BenchSpec, address: str, link_gbps: float, link_source: str, on_progress: Progress | None, stack) -> BenchReport:
    from pdkv.bench.baseline import baseline_writer
    from pdkv.bench.control import Bye, Refill, TargetClient
    from pdkv.bench.memory import KVMemory
    from pdkv.transport import open_transport

    g = spec.geometry
    layouts = expand_layouts(spec.layouts)
    shares, block_len, d_block_len = tp_layout(g, spec.block_size, *spec.tp)
    ranks = list((shares or {0: None}).items())
    num_blocks = max(blocks_needed(lay, n) for lay in layouts for n in spec.blocks)
    client = stack.enter_context(TargetClient(address))
    gpu = int(spec.src[5:]) if spec.src.startswith("cuda:") else None
    send_process = spec.transport == "socket" and gpu is not None  # as the connector's P writes GPU memory over socket
    transport: Any = stack.enter_context(open_transport(
        spec.transport, spec.hostname, spec.device, gpu=gpu, settings=spec.settings, connections=spec.connections,
        buffer_bytes=spec.socket_buffer_bytes, send_process=send_process))
    memory = KVMemory(spec.src, g.layers, block_len, num_blocks)
    stack.callback(memory.close)
    memory.fill(spec.seed)
    transport.register(memory.spans)
    stack.callback(transport.unregister, memory.spans)
    if send_process:
        transport.await_send_process(SEND_PROCESS_START_S)  # else (logged) P's own threads write, as the connector's would
    ready = client.setup(g.layers, d_block_len, num_blocks, spec.seed + 1)
    stack.callback(lambda: _say_bye(client, Bye()))
    peer = ready.session
    local_regions = memory.regions
    transport.connect(peer, ready.ipc)
    cases: list[CaseResult] = []
    for index, (n, layout) in enumerate((n, lay) for n in spec.blocks for lay in layouts):
        label = f"{layout}, {n} blocks"
        local_ids, remote_ids = block_ids(layout, n, spec.seed)
        t0 = time.perf_counter()
        by_rank = {p: case_descriptors(local_ids, remote_ids, local_regions, ready.regions, coalesces(layout), h) for p, h in ranks}
        descriptors = [d for ds in by_rank.values() for d in ds]
        plan_ms = (time.perf_counter() - t0) * 1e3
        nbytes = sum(d.length for d in descriptors)
        plan_bytes = case_plan_bytes(g, spec.tp, spec.block_size, n)
        if nbytes != plan_bytes:
            raise TransferError(f"{label}: descriptors carry {nbytes:,} B but pdkv plan says {plan_bytes:,} B")
        client.call(Refill(spec.seed + 2 + index))  # D's blocks hold other bytes until the cold write lands
        total = 1 + spec.warmup + spec.iters
        write = _writer(transport, peer, local_ids, remote_ids, local_regions, ready.regions, [h for _, h in ranks])
        t0 = time.perf_counter()
        write()
        cold_ms = (time.perf_counter() - t0) * 1e3
        verify_transfer(client, memory, descriptors, f"{label}, cold")
        if on_progress:
            on_progress(label, 1, total)
        bare_write, closer = baseline_writer(spec, transport, peer, descriptors, memory, ready) if spec.baseline else (None, None)
        try:
            samples, bare = _timed_loop(spec, write, bare_write, label, total, on_progress)
        finally:
            if closer is not None:
                closer()
        verify_transfer(client, memory, descriptors, f"{label}, after {spec.iters} timed writes")
        timing = summarize(samples, nbytes, link_gbps)
        baseline = (
            _baseline(spec, timing, bare, nbytes, link_gbps, descriptors, getattr(transport, "max_batch", len(descriptors)))
            if spec.baseline
            else None
        )
        rank_bytes = {str(p): sum(d.length for d in ds) for p, ds in by_rank.items()} if shares else {}
        cases.append(CaseResult(layout, n, nbytes, plan_bytes, len(descriptors), plan_ms, cold_ms, timing, True, baseline, rank_bytes))
    return BenchReport(
        geometry=g,
        block_size=spec.block_size,
        block_len=block_len,
        transport=spec.transport,
        device=spec.device,
        src=memory.device,
        dst=ready.device,
        link_gbps=link_gbps,
        link_source=link_source,
        target=address,
        peer=peer,
        mc_settings=transport.settings,
        cases=cases,
    )


def case_descriptors(local_ids, remote_ids, local_regions, remote_regions, coalesce: bool, heads=None) -> list[Descriptor]:
    """The connector's planning step: block ids and both sides' regions (and a share of heads) to descriptors."""
    return plan_descriptors(local_ids, remote_ids, local_regions, remote_regions, coalesce=coalesce, heads=heads)


def _writer(transport, peer: str, local_ids, remote_ids, local_regions, remote_regions, heads=(None,)) -> Callable[[], object]:
    """How the connector writes: write_blocks from block ids and both sides' regions, once per share in `heads` (None: whole)."""
    from pdkv.bench.control import BENCH_TRANSFER

    return lambda: [transport.write_blocks(peer, local_ids, remote_ids, local_regions, remote_regions, h, transfer=BENCH_TRANSFER)
                    for h in heads]


def _timed_loop(spec: BenchSpec, write, bare_write, label: str, total: int, on_progress):
    samples: list[float] = []
    bare: list[float] = []
    for i in range(spec.warmup + spec.iters):
        timed = i >= spec.warmup
        # pdkv and the baseline alternate which goes first, so neither always meets a warmer or colder link.
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                t0 = time.perf_counter()
                write()
                ms = (time.perf_counter() - t0) * 1e3
                if timed:
                    samples.append(ms)
            elif bare_write is not None:
                ms = bare_write()
                if timed:
                    bare.append(ms)
        if on_progress:
            on_progress(label, 2 + i, total)
    return samples, bare


def _baseline(
    spec: BenchSpec, timing: Timing, bare: list[float], nbytes: int, link_gbps: float, descriptors: list[Descriptor], max_batch: int
) -> BaselineResult:
    from pdkv.bench.baseline import find_transfer_engine_bench, run_transfer_engine_bench

    bare_timing = summarize(bare, nbytes, link_gbps)
    teb_gbps = teb_ratio = None
    note: str | None = None
    if spec.transport == "ipc":
        note = "baseline: plain copy_ calls, one per descriptor, inside one process"
    elif spec.transport == "cma":
        note = "baseline: plain memmove calls, one per descriptor, inside one process"
    elif spec.transport == "socket":
        note = "baseline: Mooncake tcp, the same descriptors between the same memory"
    elif not spec.transfer_engine_bench:
        note = "not asked for"
    elif spec.target is not None:
        note = "not run in two-host mode"
    elif find_transfer_engine_bench() is None:
        note = "this Mooncake wheel ships no transfer_engine_bench"
    else:
        lengths = {d.length for d in descriptors}
        try:
            teb = run_transfer_engine_bench(
                block_size=max(lengths),
                batch_size=min(len(descriptors), max_batch),
                protocol=spec.transport,
                device_name=spec.device,
                hostname=spec.hostname,
            )
            teb_gbps, teb_ratio = teb.gbps, timing.gbps_p50 / teb.gbps if teb.gbps else None
            note = "host memory" if (spec.src, spec.dst) != ("cpu", "cpu") else None
        except PdkvError as exc:
            note = exc.message
    return BaselineResult(bare_timing, timing.p50_ms / bare_timing.p50_ms, teb_gbps, teb_ratio, note)


def _say_bye(client, bye) -> None:
    with contextlib.suppress(PdkvError):
        client.call(bye)


def settings_from_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """MC_* settings for a bench run: Mooncake's INFO chatter off unless the user set MC_LOG_LEVEL."""
    out = {"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
    out.update(extra or {})
    return out

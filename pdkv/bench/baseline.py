"""Baselines for `pdkv bench --baseline`: bare TransferEngine calls and Mooncake's own transfer_engine_bench (tcp, rdma),
plain copy_ calls (ipc), plain memmove calls (cma), Mooncake tcp between the same memory (socket).

The bare loop calls `batch_transfer_sync_write` on the same engine with the
same descriptors as pdkv (cut into the same calls of at most max_batch), with
no pdkv code between the clock reads, so the
ratio of the two is what pdkv's transport adds. transfer_engine_bench moves
fixed-size blocks between two processes of its own (host memory), shaped
here like the case: its block is the case's descriptor length, its batch the
descriptor count.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from pdkv.errors import StartError, TransferError


def bare_write_ms(engine: Any, peer: str, srcs: list[int], dsts: list[int], lens: list[int], max_batch: int) -> float:
    """batch_transfer_sync_write over the descriptors in calls of `max_batch` (as the transport cuts them), timed."""
    rc = 0
    t0 = time.perf_counter()
    for i in range(0, len(lens), max_batch):
        rc = engine.batch_transfer_sync_write(peer, srcs[i : i + max_batch], dsts[i : i + max_batch], lens[i : i + max_batch])
        if rc != 0:
            break
    ms = (time.perf_counter() - t0) * 1e3
    if rc != 0:
        raise TransferError(f"bare TransferEngine write of {sum(lens):,} B to {peer} failed (rc {rc})")
    return ms


class CopyBaseline:
    """The ipc baseline: plain torch `copy_` calls, one per descriptor, from P's GPU into a same-shaped buffer on D's GPU.

    Both buffers live in this process (the easy case for copy_: no IPC), so
    the ratio shows what batching every block into one kernel buys.
    """

    def __init__(self, memory: Any, dst: str, descriptors: list, remote_regions: list) -> None:
        import torch

        from pdkv.bench.memory import KVMemory

        self.torch = torch
        self.scratch = KVMemory(dst, memory.layers, memory.block_len, memory.num_blocks)
        index = {r.base: i for i, r in enumerate(remote_regions)}
        starts = sorted(index)
        self.pairs = []
        for d in descriptors:
            base = max(b for b in starts if b <= d.dst)
            self.pairs.append((self.scratch.view_at(index[base], d.dst - base, d.length), memory.view(d.src, d.length)))
        self.devices = {int(dst[5:]), int(memory.device[5:])}

    def write_ms(self) -> float:
        torch = self.torch
        for dev in self.devices:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for dst, src in self.pairs:
            dst.copy_(src, non_blocking=True)
        for dev in self.devices:
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        self.pairs = []
        self.scratch.close()


class MemmoveBaseline:
    """The cma baseline: plain memmove calls, one per descriptor, from P's buffers into a same-shaped buffer of this process.

    No process boundary and no system call: the floor a copy between two
    processes' host memory can approach.
    """

    def __init__(self, memory: Any, descriptors: list, remote_regions: list) -> None:
        import ctypes

        from pdkv.bench.memory import KVMemory

        self.memmove = ctypes.memmove
        self.scratch = KVMemory("cpu", memory.layers, memory.block_len, memory.num_blocks)
        local = {r.base: s.base for r, s in zip(remote_regions, self.scratch.regions, strict=True)}
        starts = sorted(local)
        self.triples = []
        for d in descriptors:
            base = max(b for b in starts if b <= d.dst)
            self.triples.append((local[base] + d.dst - base, d.src, d.length))

    def write_ms(self) -> float:
        memmove = self.memmove
        t0 = time.perf_counter()
        for dst, src, n in self.triples:
            memmove(dst, src, n)
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        self.triples = []
        self.scratch.close()


def baseline_writer(spec: Any, transport: Any, peer: str, descriptors: list, memory: Any, ready: Any) -> tuple[Any, Any]:
    """The baseline write for this transport and what closes it: bare TransferEngine calls, (ipc) plain copy_ calls,
    (cma) plain memmove calls, or (socket) Mooncake tcp's writes of the same descriptors between the same memory."""
    remote_regions = ready.regions
    if spec.transport == "socket":
        tcp = MooncakeTcpBaseline(spec, memory, descriptors, ready.baseline_session)
        return tcp.write_ms, tcp.close
    if spec.transport == "ipc":
        copier = CopyBaseline(memory, spec.dst, descriptors, remote_regions)
        return copier.write_ms, copier.close
    if spec.transport == "cma":
        mover = MemmoveBaseline(memory, descriptors, remote_regions)
        return mover.write_ms, mover.close
    engine = transport.engine
    srcs, dsts, lens = [d.src for d in descriptors], [d.dst for d in descriptors], [d.length for d in descriptors]
    return (lambda: bare_write_ms(engine, peer, srcs, dsts, lens, transport.max_batch)), None


class MooncakeTcpBaseline:
    """The socket baseline: Mooncake tcp's writes of the same descriptors into the target's Mooncake session on the
    same memory (`session`, from the target's Ready), so both transports meet the same bytes in the same run."""

    def __init__(self, spec: Any, memory: Any, descriptors: list, session: str) -> None:
        from pdkv.transport import open_transport

        if not session:
            raise TransferError("the bench target runs no Mooncake tcp beside the socket transport",
                                hint="install Mooncake, or drop --baseline")
        self.session, self.descriptors = session, descriptors
        self.mooncake = open_transport("tcp", spec.hostname, settings=spec.settings)
        self.mooncake.register(memory.spans)

    def write_ms(self) -> float:
        t0 = time.perf_counter()
        self.mooncake.write(self.session, self.descriptors)
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        self.mooncake.close()


class TebResult(msgspec.Struct, frozen=True):
    """transfer_engine_bench's own figure for blocks of `block_size` B in batches of `batch_size`."""

    gbps: float
    batches: int
    seconds: float
    block_size: int
    batch_size: int
    memory: str = "cpu"


def find_transfer_engine_bench() -> str | None:
    """The transfer_engine_bench binary the Mooncake wheel ships, or None."""
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / "transfer_engine_bench"
    if path.is_file() and os.access(path, os.X_OK):
        return str(path)
    return shutil.which("transfer_engine_bench")


_LISTEN = re.compile(r"listening on ([\w.\-:\[\]]+):(\d+)")
_RESULT = re.compile(r"batch count (\d+), throughput ([\d.]+) GB/s")


def run_transfer_engine_bench(
    *,
    block_size: int,
    batch_size: int,
    protocol: str = "tcp",
    device_name: str = "",
    hostname: str = "127.0.0.1",
    seconds: int = 2,
    start_timeout_s: float = 30.0,
) -> TebResult:
    """Run transfer_engine_bench's target and initiator on this host (P2P handshake, write) and parse its throughput."""
    binary = find_transfer_engine_bench()
    if binary is None:
        raise StartError("this Mooncake wheel ships no transfer_engine_bench")
    buffer = max(block_size * batch_size, 1 << 26)
    common = [
        "--metadata_server=P2PHANDSHAKE",
        f"--protocol={protocol}",
        f"--local_server_name={hostname}",
        f"--buffer_size={buffer}",
        "--report_unit=GB",
    ]
    if device_name:
        common.append(f"--device_name={device_name}")
    env = {**os.environ, "MC_LOG_LEVEL": "INFO"}  # the listening line and the result are INFO lines
    with tempfile.TemporaryFile("w+") as log:
        target = subprocess.Popen(
            [binary, "--mode=target", *common], stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
        try:
            port = _wait_for_port(log, target, start_timeout_s)
            init = subprocess.run(
                [
                    binary,
                    "--mode=initiator",
                    *common,
                    f"--segment_id={hostname}:{port}",
                    "--operation=write",
                    f"--duration={seconds}",
                    "--threads=1",
                    f"--batch_size={batch_size}",
                    f"--block_size={block_size}",
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=seconds + start_timeout_s,
                preexec_fn=_die_with_parent,
            )
        except subprocess.TimeoutExpired:
            raise TransferError("transfer_engine_bench did not finish in time") from None
        finally:
            target.kill()
            target.wait(10)
    found = _RESULT.search(init.stdout + init.stderr)
    if init.returncode != 0 or not found:
        tail = (init.stdout + init.stderr).strip().splitlines()[-3:]
        raise TransferError(f"transfer_engine_bench failed (exit {init.returncode}): {' | '.join(tail)}")
    return TebResult(float(found.group(2)), int(found.group(1)), float(seconds), block_size, batch_size)


def _die_with_parent() -> None:
    # The target never exits by itself: if this process is killed (a timeout), take it along.
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def _wait_for_port(log: Any, proc: subprocess.Popen, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log.seek(0)
        found = _LISTEN.search(log.read())
        if found:
            return int(found.group(2))
        if proc.poll() is not None:
            raise StartError(f"transfer_engine_bench target exited with {proc.returncode}")
        time.sleep(0.05)
    raise StartError(f"transfer_engine_bench target did not listen within {timeout_s:g} s")

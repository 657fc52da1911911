"""The socket transport's connections and socket buffers, swept: one 141.75 MiB write (the seed's 63 blocks of
Qwen3-8B as 36 layer-sized descriptors) from this process into a second one over 127.0.0.1, bytes not verified
(`pdkv bench --transport socket` verifies them), p50 of 12 writes after 2 warm-up writes.

`--raw` also times the same bytes over bare sockets in the same run, alternating with the transport: N connections
with the same buffers, each carrying its share with one `sendall` into one `recv_into(MSG_WAITALL)` and a one-byte
answer, no frames, checks or handshake: what the kernel's TCP alone takes on this host, the transport's ceiling.

Run: python benchmarks/socket_lanes.py [--buffers 0,131072,262144,524288,1048576] [--connections 1,2,4,8] [--raw]
(0: the kernel's autotuned socket buffers). docs/socket.md and docs/bench.md quote it.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv.transport import Descriptor  # noqa: E402
from pdkv.transport.sockets import SocketTransport  # noqa: E402

NBYTES = 148_635_648
LAYERS = 36


def _decode(queue, stop, buffer_bytes: int, raw: bool) -> None:
    dst = (ctypes.c_char * NBYTES)()
    base = ctypes.addressof(dst)
    bare = _raw_listener(memoryview(dst).cast("B"), buffer_bytes) if raw else None  # only for --raw
    with SocketTransport(buffer_bytes=buffer_bytes) as d:
        d.register([(base, NBYTES)])
        d.expect("sweep", [(base, NBYTES)])
        queue.put((d.session_address, base, bare.getsockname()[1] if bare else 0))
        stop.wait(600)


def _sized(sock: socket.socket, buffer_bytes: int) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    return sock


def _raw_listener(dst: memoryview, buffer_bytes: int) -> socket.socket:
    """Bare sockets into `dst`: each connection first says its share (offset, length: 16 bytes), then receives
    that share once a write, answering one byte each time."""
    ls = _sized(socket.socket(), buffer_bytes)
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)

    def serve(conn: socket.socket) -> None:
        head = conn.recv(16, socket.MSG_WAITALL)
        off, n = int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")
        view = dst[off : off + n]
        while conn.recv_into(view, n, socket.MSG_WAITALL) == n:
            conn.sendall(b"k")

    def accept() -> None:
        while True:
            conn, _ = ls.accept()
            threading.Thread(target=serve, args=(_sized(conn, buffer_bytes),), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return ls


class RawWriter:
    """P's side of the bare sockets: `n` connections, each sending its share of `src` with one sendall."""

    def __init__(self, src: memoryview, port: int, n: int, buffer_bytes: int) -> None:
        share = -(-NBYTES // n)
        self.parts = [(off, min(share, NBYTES - off)) for off in range(0, NBYTES, share)]
        self.src = src
        self.socks = [_sized(socket.create_connection(("127.0.0.1", port)), buffer_bytes) for _ in self.parts]
        for sock, (off, length) in zip(self.socks, self.parts, strict=True):
            sock.sendall(off.to_bytes(8, "little") + length.to_bytes(8, "little"))

    def write(self) -> None:
        failed: list[BaseException] = []

        def one(sock: socket.socket, off: int, length: int) -> None:
            try:
                sock.sendall(self.src[off : off + length])
                if sock.recv(1) != b"k":
                    raise ConnectionError("the bare receiver closed")
            except OSError as exc:
                failed.append(exc)

        threads = [threading.Thread(target=one, args=(s, *part)) for s, part in zip(self.socks, self.parts, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise SystemExit(f"bare sockets: {failed[0]}")

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def _p50(times: list[float]) -> tuple[float, float]:
    times = sorted(times[2:])
    return times[len(times) // 2], times[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buffers", default="0,131072,262144,524288,1048576")
    ap.add_argument("--connections", default="1,2,4,8")
    ap.add_argument("--raw", action="store_true", help="bare sockets beside the transport, same bytes, alternated")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    src = (ctypes.c_char * NBYTES)()
    a = ctypes.addressof(src)
    step = NBYTES // LAYERS
    print(f"{'buffer':>10} {'connections':>11} {'p50 ms':>8} {'GB/s':>6} {'min ms':>7}"
          + (f" {'raw p50':>8} {'raw min':>8} {'raw/socket':>10}" if args.raw else ""))
    for buf in map(int, args.buffers.split(",")):
        queue, stop = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_decode, args=(queue, stop, buf, args.raw), daemon=True)
        proc.start()
        session, b, raw_port = queue.get(timeout=60)
        for n in map(int, args.connections.split(",")):
            raw = RawWriter(memoryview(src).cast("B"), raw_port, n, buf) if args.raw else None
            with SocketTransport(writable=False, connections=n, buffer_bytes=buf) as p:
                p.register([(a, NBYTES)])
                descriptors = [Descriptor(a + i * step, b + i * step, step) for i in range(LAYERS)]
                times, raw_times = [], []
                for _ in range(14):
                    t0 = time.perf_counter()
                    p.write(session, descriptors, transfer="sweep")
                    times.append(time.perf_counter() - t0)
                    if raw is not None:
                        t0 = time.perf_counter()
                        raw.write()
                        raw_times.append(time.perf_counter() - t0)
            p50, least = _p50(times)
            label = "autotuned" if buf == 0 else f"{buf >> 10} KiB"
            line = f"{label:>10} {n:>11} {p50 * 1e3:8.1f} {NBYTES / p50 / 1e9:6.2f} {least * 1e3:7.1f}"
            if raw is not None:
                raw.close()
                r50, rmin = _p50(raw_times)
                line += f" {r50 * 1e3:8.1f} {rmin * 1e3:8.1f} {r50 / p50:10.2f}"
            print(line, flush=True)
        stop.set()
        proc.join(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

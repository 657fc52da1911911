"""The benchmark's decode side: a ZMQ REP control channel in front of D's KV memory and transport.

`pdkv bench serve` runs one on the decode host; a local benchmark starts one in
a child process. The prefill side asks it to allocate regions shaped like the
model's (`Setup`), to refill them (`Refill`) and to hash the ranges that
arrived (`Checksum`); the KV bytes themselves never cross this channel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import msgspec

from pdkv.errors import PdkvError, RemoteError, StartError, UnreachableError
from pdkv.peer_address import advertised_address
from pdkv.bounds import Address, BlockCount, Length, check_span
from pdkv.wire import IpcExport, Region

DEFAULT_CONTROL_TIMEOUT_S = 60.0
BENCH_TRANSFER = "bench"  # the one transfer a target expects writes under (Transport.expect): its whole KV memory
MAX_LAYERS = 4096  # KV regions per model; the deepest models have a few hundred layers

# Seeds feed numpy's and torch's generators (torch's after scaling by 100_003, inside 64 bits).
Seed = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class Setup(msgspec.Struct, tag="setup", tag_field="op", frozen=True):
    layers: Annotated[int, msgspec.Meta(gt=0, le=MAX_LAYERS)]
    block_len: Length
    num_blocks: BlockCount
    seed: Seed


class Refill(msgspec.Struct, tag="refill", tag_field="op", frozen=True):
    seed: Seed


class Checksum(msgspec.Struct, tag="checksum", tag_field="op", frozen=True):
    ranges: list[tuple[Address, Length]]

    def __post_init__(self) -> None:
        for i, (addr, length) in enumerate(self.ranges):
            check_span(f"checksum ranges[{i}]", addr, length)


class Bye(msgspec.Struct, tag="bye", tag_field="op", frozen=True):
    pass


Request = Setup | Refill | Checksum | Bye


class Ready(msgspec.Struct, tag="ready", tag_field="op", frozen=True):
    session: str
    regions: list[Region]
    device: str
    transport: str
    ipc: IpcExport | None = None  # transport ipc: the CUDA IPC handles of `regions`
    # transport socket: a Mooncake tcp session on the same memory, the baseline's ("": Mooncake not installed)
    baseline_session: str = ""


class Digest(msgspec.Struct, tag="digest", tag_field="op", frozen=True):
    hex: str


class Ok(msgspec.Struct, tag="ok", tag_field="op", frozen=True):
    pass


class Failed(msgspec.Struct, tag="failed", tag_field="op", frozen=True):
    message: str


Reply = Ready | Digest | Ok | Failed

_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


class BenchTarget:
    """D's side: a transport, KV memory on `dst`, and a REP socket on host:port (0 picks a port)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise: str | None = None,
        transport: str = "tcp",
        device_name: str = "",
        dst: str = "cpu",
        settings: Mapping[str, str] | None = None,
        max_bytes: int | None = None,
        socket_buffer_bytes: int | None = None,
    ) -> None:
        """`max_bytes`: the most KV memory one Setup may ask for (default: half the host memory available now,
        for host memory), so that whoever reaches the control port cannot exhaust the host. `socket_buffer_bytes`:
        transport socket's (None: its default)."""
        import zmq

        from pdkv.bench.memory import parse_device
        from pdkv.transport import open_transport

        self.dst = parse_device(dst)
        if transport == "ipc" and not self.dst.startswith("cuda:"):
            raise StartError("transport ipc needs GPU memory on the decode side", hint="pass --dst cuda:N")
        if transport == "cma" and self.dst != "cpu":
            raise StartError("transport cma moves host memory", hint="pass --dst cpu")
        self.transport_name = transport
        bind_host = host or "0.0.0.0"
        # Mooncake needs a concrete address to advertise: the one we bind, or the caller's choice.
        self.advertise = advertise or (bind_host if bind_host not in ("0.0.0.0", "::") else _primary_address())
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self._sock.bind(f"tcp://{bind_host}:{port}")
                bound = port
            else:
                bound = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise StartError(f"cannot listen on {bind_host}:{port}: {exc}", hint="pick another --port") from None
        self.address = f"{self.advertise}:{bound}"
        gpu = int(self.dst[5:]) if self.dst.startswith("cuda:") else None
        self.transport = open_transport(transport, self.advertise, device_name, gpu=gpu, settings=settings,
                                        buffer_bytes=socket_buffer_bytes)
        self.baseline: Any = None  # transport socket: Mooncake tcp beside it, for the baseline in the same run
        if transport == "socket":
            try:
                self.baseline = open_transport("tcp", self.advertise, gpu=gpu, settings=settings)
            except PdkvError:
                self.baseline = None
        self.memory: Any = None
        self.requests = 0
        self.max_bytes = max_bytes if max_bytes is not None else (_available_bytes() // 2 if self.dst == "cpu" else None)

    def handle(self, req: Request) -> Reply:
        """Answer one request; errors become Failed replies so the prefill side can report them."""
        from pdkv.bench.memory import KVMemory

        try:
            if isinstance(req, Setup):
                want = req.layers * req.block_len * req.num_blocks
                if self.max_bytes is not None and want > self.max_bytes:
                    return Failed(f"Setup asks for {want} B of KV memory; this target serves at most {self.max_bytes} B")
                self._free()
                self.memory = KVMemory(self.dst, req.layers, req.block_len, req.num_blocks)
                self.memory.fill(req.seed)
                self.transport.register(self.memory.spans)
                self.transport.expect(BENCH_TRANSFER, self.memory.spans)
                if self.baseline is not None:
                    self.baseline.register(self.memory.spans)
                export = self.transport.hello()
                return Ready(self.transport.session_address, self.memory.regions, self.dst, self.transport_name, export,
                             self.baseline.session_address if self.baseline is not None else "")
            if self.memory is None:
                return Failed("no Setup received yet")
            if isinstance(req, Refill):
                self.memory.fill(req.seed)
                return Ok()
            if isinstance(req, Checksum):
                return Digest(self.memory.digest(req.ranges))
            return Ok()
        except PdkvError as exc:
            return Failed(exc.message)
        except Exception as exc:  # a bad request must not end the server
            return Failed(f"{type(exc).__name__}: {exc}")

    def serve(self, *, stop: threading.Event | None = None, once: bool = False, alive: Callable[[], bool] | None = None) -> None:
        """Answer requests until `stop` is set, `alive()` turns false, or (with `once`) a Bye arrives."""
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not (stop is not None and stop.is_set()) and (alive is None or alive()):
            if not poller.poll(200):
                continue
            raw = self._sock.recv()
            self.requests += 1
            try:
                req = _request_decoder.decode(raw)
            except msgspec.DecodeError as exc:
                self._sock.send(_encoder.encode(Failed(f"bad request: {exc}")))
                continue
            self._sock.send(_encoder.encode(self.handle(req)))
            if isinstance(req, Bye):
                self._free()
                if once:
                    return

    def _free(self) -> None:
        if self.memory is not None:
            self.transport.forget(BENCH_TRANSFER)
            self.transport.unregister(self.memory.spans)
            if self.baseline is not None:
                self.baseline.unregister(self.memory.spans)
            self.memory.close()
            self.memory = None

    def close(self) -> None:
        self._free()
        self.transport.close()
        if self.baseline is not None:
            self.baseline.close()
        self._sock.close()
        self._ctx.term()

    def __enter__(self) -> BenchTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TargetClient:
    """The prefill side's handle on a BenchTarget at "host:port"; every call bounded by `timeout_s`."""

    def __init__(self, address: str, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> None:
        import zmq

        self.address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        for opt, value in ((zmq.LINGER, 0), (zmq.RCVTIMEO, int(timeout_s * 1000)), (zmq.SNDTIMEO, int(timeout_s * 1000))):
            self._sock.setsockopt(opt, value)
        self._sock.connect(f"tcp://{address}")
        self.timeout_s = timeout_s

    def call(self, req: Request) -> Reply:
        import zmq

        try:
            self._sock.send(_encoder.encode(req))
            reply = _reply_decoder.decode(self._sock.recv())
        except zmq.Again:
            raise UnreachableError(
                f"bench target {self.address} did not answer {type(req).__name__} within {self.timeout_s:g} s",
                hint="is `pdkv bench serve` running there, and is its port open?",
            ) from None
        except msgspec.DecodeError as exc:
            raise RemoteError(f"bench target {self.address} sent an unreadable reply: {exc}") from None
        if isinstance(reply, Failed):
            raise RemoteError(f"bench target {self.address}: {reply.message}")
        return reply

    def setup(self, layers: int, block_len: int, num_blocks: int, seed: int) -> Ready:
        reply = self.call(Setup(layers, block_len, num_blocks, seed))
        if not isinstance(reply, Ready):
            raise RemoteError(f"bench target {self.address} answered Setup with {type(reply).__name__}")
        return reply

    def checksum(self, ranges: list[tuple[int, int]]) -> str:
        reply = self.call(Checksum(ranges))
        if not isinstance(reply, Digest):
            raise RemoteError(f"bench target {self.address} answered Checksum with {type(reply).__name__}")
        return reply.hex

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()

    def __enter__(self) -> TargetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _primary_address() -> str:
    """The address `pdkv up` would advertise (pdkv.peer_address); loopback on a host with none."""
    try:
        return advertised_address()
    except StartError:
        return "127.0.0.1"


def _available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)

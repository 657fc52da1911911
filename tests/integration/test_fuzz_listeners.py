"""10,000 random and mutated messages at each of pdkv's listeners, seeded: each still answers afterwards, the
registry and the transfer in flight are as they were, and no memory outside registered regions is written.

Messages: random bytes; pdkv's own valid messages with bytes flipped, inserted, deleted or cut; and valid
messages with fields swapped for random values of random types (so that many decode and reach the logic).
Real sockets on 127.0.0.1 throughout: P's side channel (a KVSender over Mooncake tcp, with and without the
deployment key), the bootstrap server (with its key), the proxy (with API and admin keys) and the bench's
control channel.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import zmq
from support.kv_pair import KVHarness, wait_phase, wait_results
from support.proxy_stubs import REQUEST, Deployment

from pdkv.auth import FrameSealer, new_binding
from pdkv.bench.control import BenchTarget, Checksum, Refill, Setup, TargetClient
from pdkv.bootstrap import BootstrapClient, ProbePolicy, start_background
from pdkv.connector.receiver import PullSpec
from pdkv.connector.send_table import Phase
from pdkv.wire import Announce, PullReply, PullRequest, RegisterRequest, Release, StatsQuery, StatsReply, TraceReport, decode_reply, encode
from pdkv.proxy.guard import HttpGuard

N = 10_000
SEED = 20261202
LAYERS, BLOCKS, BLOCK_LEN = 2, 8, 256
KEY = "fuzz-deployment-key"


# --- message generators ------------------------------------------------------------


def _random_value(rng: random.Random) -> Any:
    return rng.choice([
        lambda: rng.randint(-(2**70), 2**70), lambda: rng.randint(-3, 2**31 + 3), lambda: rng.random() * 1e20, lambda: float("nan"),
        lambda: "".join(rng.choice("ab/:.\x00é0") for _ in range(rng.randint(0, 12))), lambda: None, lambda: True,
        lambda: [rng.randint(-2, 20) for _ in range(rng.randint(0, 5))], lambda: {"k": rng.randint(0, 9)}, lambda: b"\xff" * 3,
    ])()


def _mutate_fields(rng: random.Random, value: Any) -> Any:
    """The same shape with one field (at any depth) replaced, dropped or added."""
    if isinstance(value, dict) and value:
        out = dict(value)
        key = rng.choice(list(out))
        roll = rng.random()
        if roll < 0.6:
            out[key] = _random_value(rng) if rng.random() < 0.7 else _mutate_fields(rng, out[key])
        elif roll < 0.8:
            del out[key]
        else:
            out[rng.choice(["extra", "type", "op", key])] = _random_value(rng)
        return out
    if isinstance(value, list) and value:
        out = list(value)
        i = rng.randrange(len(out))
        out[i] = _mutate_fields(rng, out[i])
        return out
    return _random_value(rng)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if not b or op < 0.3:
            b.insert(rng.randint(0, len(b)), rng.randrange(256))
        elif op < 0.6:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.8:
            del b[rng.randrange(len(b))]
        else:
            b = b[: rng.randint(0, len(b))]
    return bytes(b)


def messages(rng: random.Random, valid: list[Any], encode_raw: Callable[[Any], bytes], n: int = N) -> Iterator[bytes]:
    """`n` frames: a third random bytes, a third byte-mutated valid ones, a third field-mutated valid ones."""
    raws = [msgspec.to_builtins(v) for v in valid]
    for i in range(n):
        kind = i % 3
        if kind == 0:
            yield rng.randbytes(rng.randint(0, 300))
        elif kind == 1:
            yield _mutate_bytes(rng, encode_raw(rng.choice(raws)))
        else:
            try:
                yield encode_raw(_mutate_fields(rng, rng.choice(raws)))
            except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
                yield rng.randbytes(8)


def _raw_msgpack(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


# --- the side channel ----------------------------------------------------------------


@pytest.mark.parametrize("keyed", [True, False], ids=["key", "no-key"])
def test_side_channel_survives_fuzz_and_the_transfer_in_flight_is_untouched(kv: KVHarness, keyed: bool):
    rng = random.Random(SEED)
    # D's registered blocks sit between two canaries: nothing may ever be written there.
    d_buf = np.zeros((LAYERS * BLOCKS + 2) * BLOCK_LEN, np.uint8)
    p = kv.side(fill=1, shape=(LAYERS, BLOCKS, BLOCK_LEN))
    d = kv.side(fill=None, mem=d_buf[BLOCK_LEN:-BLOCK_LEN].reshape(LAYERS, BLOCKS, BLOCK_LEN))
    sealer = FrameSealer(KEY) if keyed else None
    sender = kv.sender(p, engine_id="e", sealer=sealer)
    secret, commitment = new_binding()
    sender.apply_step(registered={"p1": "xfer-live"}, bindings={"xfer-live": commitment})
    sender.apply_step(ready={"p1": ("xfer-live", [1, 2, 3])})
    wait_phase(sender, "xfer-live", Phase.READY)
    before = (sender.table.entries["xfer-live"].phase, list(sender.table.entries["xfer-live"].blocks or []))
    session = d.transport.session_address
    valid = [
        Announce(session=session, tp_rank=0, tp_size=1, regions=d.regions),
        # Pulls and releases for the live transfer, with any secret but its own.
        PullRequest(transfer_id="xfer-live", d_req_id="f", session=session, tp_rank=0, tp_size=1, block_ids=[0, 1, 2],
                    binding=new_binding()[0]),
        Release(transfer_id="xfer-live", d_req_id="f", binding=new_binding()[0]),
        Release(transfer_id="xfer-live", d_req_id=""),
        TraceReport(transfer_id="xfer-live", events={"a": 1.0}),
        StatsQuery(since=0.0),
    ]
    # Keyed: the field-mutated third is sealed with the key (a key holder sending garbage reaches decoding);
    # the byte-mutated third breaks its seal, and random bytes have none.
    enc = (lambda raw: sealer.seal(_raw_msgpack(raw), b"q")) if sealer is not None else _raw_msgpack
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(sender.address)
    start = time.monotonic()
    for frame in messages(rng, valid, enc):
        sock.send(frame)
    # Still answering, and done with every fuzz frame: a pull for an id no mutation makes (its answer comes
    # after every earlier frame's), then a stats query; both sealed when keyed.
    probes = [PullRequest(transfer_id="xfer-probe", d_req_id="probe", session="127.0.0.1:9", tp_rank=0, tp_size=1,
                          block_ids=[0]), StatsQuery(since=time.time())]
    for probe in map(encode, probes):
        sock.send(sealer.seal(probe, b"q") if sealer else probe)
    deadline = time.monotonic() + 60
    probed, got = False, None
    while time.monotonic() < deadline and got is None:
        if sock.poll(200):
            frame = sock.recv()
            body = sealer.open(frame, b"r")[0] if sealer else frame
            msg = decode_reply(body) if body is not None else None
            if isinstance(msg, PullReply) and msg.transfer_id == "xfer-probe":
                probed = True
            elif probed and isinstance(msg, StatsReply):
                got = msg
    elapsed = time.monotonic() - start
    sock.close()
    ctx.term()
    assert got is not None, "the side channel stopped answering"
    if keyed:
        assert sender.trace.auth_refused_total("unauthenticated") >= 2 * N // 3 - 5  # dropped before decoding
    e = sender.table.entries["xfer-live"]
    assert (e.phase, list(e.blocks or [])) == before and e.served == 0 and not e.sending
    assert not d_buf.any(), "memory was written"
    # The right D still gets exactly its KV.
    receiver = kv.receiver(d, liveness_s=5.0, sealer=FrameSealer(KEY) if keyed else None)
    receiver.apply_step(pulls=[PullSpec("d1", "xfer-live", kv.bootstrap_url, "e", [5, 6, 7], binding=secret)])
    assert wait_results(receiver, {"d1"}).failed == {}
    assert np.array_equal(d.mem[:, 5:8], p.mem[:, 1:4])
    assert not d.mem[:, :5].any() and not d_buf[:BLOCK_LEN].any() and not d_buf[-BLOCK_LEN:].any()
    assert elapsed < 60


# --- the bootstrap ------------------------------------------------------------------


def _http_burst(port: int, requests: Iterator[bytes]) -> int:
    """Send each request on a fresh connection, read what comes back; how many got an HTTP status line."""
    answered = 0
    for req in requests:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            try:
                s.sendall(req)
                if b"content-length" not in req:  # a broken head: end the request so the server need not wait for more
                    s.shutdown(socket.SHUT_WR)
                head = s.recv(16)
            except OSError:
                continue
            answered += head.startswith(b"HTTP/1.")
    return answered


def _http_requests(rng: random.Random, paths: list[str], bodies: list[Any], auth: str | None) -> Iterator[bytes]:
    for i, body in enumerate(messages(rng, bodies, msgspec.json.encode)):
        path = rng.choice(paths) if i % 5 else "/" + rng.randbytes(4).hex()
        method = rng.choice([b"POST", b"POST", b"GET", b"PUT", b"DELETE"])
        headers = b"host: x\r\ncontent-type: application/json\r\n"
        if auth and i % 7 == 0:
            headers += b"authorization: Bearer " + auth.encode() + b"\r\n"
        if i % 23 == 0:  # a head that is itself broken
            yield _mutate_bytes(rng, b"%s %s HTTP/1.1\r\n%s\r\n" % (method, path.encode(), headers)) + body
        else:
            yield b"%s %s HTTP/1.1\r\n%scontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
                method, path.encode(), headers, len(body), body)


def test_bootstrap_survives_fuzz_and_its_registry_is_unchanged():
    rng = random.Random(SEED + 1)
    bs = start_background("127.0.0.1", 0, token=KEY, probe=ProbePolicy(interval=0))
    try:
        with BootstrapClient(bs.url, token=KEY) as c:
            c.register(RegisterRequest(engine_id="engine-a", dp_rank=0, tp_rank=0, pp_rank=0, addr="tcp://127.0.0.1:5555"))
            before = httpx.get(bs.url + "/query", trust_env=False).json()
        bodies = [
            msgspec.to_builtins(RegisterRequest(engine_id="engine-b", dp_rank=0, tp_rank=0, pp_rank=0, addr="tcp://127.0.0.1:1")),
            {"engine_id": "engine-a"},
        ]
        # Most carry no key or a wrong one; every seventh the real key, which a mutated body must not get past either.
        port = int(bs.url.rsplit(":", 1)[1])
        answered = _http_burst(port, _http_requests(rng, ["/register", "/deregister", "/query", "/health"], bodies, "wrong-key"))
        assert answered > N * 0.9
        assert httpx.get(bs.url + "/health", trust_env=False).status_code == 200
        assert httpx.get(bs.url + "/query", trust_env=False).json() == before
    finally:
        bs.stop()


# --- the proxy ------------------------------------------------------------------------


def test_proxy_survives_fuzz_and_no_backend_sees_an_unauthorised_request():
    rng = random.Random(SEED + 2)
    guard = HttpGuard(api_keys=("sk-fuzz",), admin_key="adm-fuzz")
    with Deployment(guard=guard) as dep:
        port = int(dep.url.rsplit(":", 1)[1])
        paths = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/pdkv/requests", "/health"]
        answered = _http_burst(port, _http_requests(rng, paths, [REQUEST, {"messages": [{"role": "user", "content": "hi"}]}], "wrong"))
        assert answered > N * 0.9
        assert not dep.prefills[0].seen and not dep.decodes[0].seen
        with httpx.Client(base_url=dep.url, timeout=10, trust_env=False) as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/completions", json={**REQUEST, "stream": False}, headers={"Authorization": "Bearer sk-fuzz"})
            assert r.status_code == 200


# --- the bench's control channel ------------------------------------------------------


def test_bench_control_survives_fuzz():
    rng = random.Random(SEED + 3)
    # Mutated Setups ask for up to hundreds of GiB: bounded here to 64 MiB so the fuzz does not fill this host's memory.
    with BenchTarget("127.0.0.1", 0, max_bytes=64 * 2**20) as target:
        import threading

        stop = threading.Event()
        server = threading.Thread(target=target.serve, kwargs={"stop": stop}, daemon=True)
        server.start()
        try:
            valid = [Setup(2, 256, 4, 1), Refill(2), Checksum([(0, 16)])]
            ctx = zmq.Context()
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(f"tcp://{target.address}")
            for frame in messages(rng, valid, _raw_msgpack):
                sock.send(frame)
                sock.recv()  # every frame gets an answer (Failed for what does not decode)
            sock.close()
            ctx.term()
            assert target.requests >= N
            with TargetClient(target.address, timeout_s=10) as client:
                ready = client.setup(2, 256, 4, 7)
                r = ready.regions[0]
                assert len(client.checksum([(r.base, r.block_len)])) == 64
        finally:
            stop.set()
            server.join(5)

"""A stranger on P's network against a real P/D pair with the deployment key set.

Real processes and sockets: P's KVSender and D's KVReceiver (real ZMQ, a real
bootstrap server, real Mooncake tcp on loopback) in this process, and the
stranger (tests/integration/stranger.py) in a process of its own with its own
Mooncake memory. It knows P's side-channel address and the live transfer_id.
Without the key P would write this prompt's KV into the stranger's memory
(see test_without_the_key_a_stranger_gets_the_kv, which shows the attack).
With it: P sends nothing, logs the refusal, and the real D still gets its KV.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdkv.auth import FrameSealer, new_binding
from pdkv.bootstrap.client import BootstrapClient
from pdkv.bootstrap.server import start_background
from pdkv.connector.receiver import KVReceiver, PullSpec
from pdkv.connector.sender import KVSender
from pdkv.protocol import RegisterRequest, Region
from pdkv.transport import open_transport

LAYERS, BLOCKS, BLOCK_LEN = 3, 16, 512
ENGINE = "engine-p"
KEY = "deployment-key-for-the-attack-test"
STRANGER = Path(__file__).with_name("stranger.py")
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Pair:
    p_mem: np.ndarray
    d_mem: np.ndarray
    sender: KVSender
    receiver: KVReceiver
    bootstrap_url: str
    recorded: list[bytes]  # every sealed frame D sent, as it left D

    def spec(self, d_req: str, tid: str, blocks: list[int], binding: str = "") -> PullSpec:
        return PullSpec(d_req, tid, self.bootstrap_url, ENGINE, blocks, binding=binding)


def _memory(stack: ExitStack, fill: int | None) -> tuple[np.ndarray, Any, list[Region]]:
    shape = (LAYERS, BLOCKS, BLOCK_LEN)
    mem = np.random.default_rng(fill).integers(1, 255, size=shape, dtype=np.uint8) if fill is not None else np.zeros(shape, np.uint8)
    t = stack.enter_context(open_transport("tcp", "127.0.0.1", write_timeout_s=3.0))
    t.register([(mem.ctypes.data, mem.nbytes)])
    regions = [Region(mem.ctypes.data + layer * BLOCKS * BLOCK_LEN, BLOCK_LEN, BLOCKS) for layer in range(LAYERS)]
    return mem, t, regions


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    with ExitStack() as stack:
        bs = start_background("127.0.0.1", 0)
        stack.callback(bs.stop)

        def make(key: str | None = KEY) -> Pair:
            p_mem, pt, p_regions = _memory(stack, fill=7)
            d_mem, dt, d_regions = _memory(stack, fill=None)
            sender = stack.enter_context(KVSender(pt, p_regions, host="127.0.0.1", engine_id=ENGINE, heartbeat_s=0.2,
                                                  sealer=FrameSealer(key) if key else None))
            with BootstrapClient(bs.url) as c:
                c.register(RegisterRequest(engine_id=ENGINE, dp_rank=0, tp_rank=0, pp_rank=0, addr=sender.address))
            d_sealer = FrameSealer(key) if key else None
            recorded: list[bytes] = []
            if d_sealer is not None:
                seal = d_sealer.seal

                def recording(body: bytes, direction: bytes) -> bytes:
                    out = seal(body, direction)
                    recorded.append(out)
                    return out

                d_sealer.seal = recording  # type: ignore[method-assign]
            receiver = stack.enter_context(KVReceiver(dt.session_address, d_regions, liveness_s=5.0, sealer=d_sealer))
            return Pair(p_mem, d_mem, sender, receiver, bs.url, recorded)

        yield make


def stranger(addr: str, tid: str, mode: str, tmp_path: Path | None = None, frames: list[bytes] | None = None,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    args = [sys.executable, str(STRANGER), addr, tid, mode]
    if frames is not None:
        assert tmp_path is not None
        f = tmp_path / "frames.hex"
        f.write_text("\n".join(x.hex() for x in frames))
        args.append(str(f))
    out = subprocess.run(args, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_done(receiver: KVReceiver, d_req: str, timeout: float = 10.0) -> str | None:
    """The pull's error, or None once its KV arrived."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = receiver.take_results()
        if d_req in r.finished:
            return r.failed.get(d_req)
        time.sleep(0.01)
    raise AssertionError(f"pull {d_req} did not conclude within {timeout} s")


def assert_d_got_the_kv(pair: Pair, p_blocks: list[int], d_blocks: list[int]) -> None:
    for layer in range(LAYERS):
        for pb, db in zip(p_blocks, d_blocks, strict=True):
            assert np.array_equal(pair.p_mem[layer, pb], pair.d_mem[layer, db]), f"layer {layer} block {pb}->{db}"


def live_transfer(pair: Pair, tid: str, commitment: str = "") -> None:
    """P computed a prompt into blocks 2..5 and holds it for the transfer `tid`, bound to the D holding the secret."""
    pair.sender.apply_step(registered={"p1": tid}, bindings={tid: commitment} if commitment else None)
    pair.sender.apply_step(ready={"p1": (tid, [2, 3, 4, 5])})
    time.sleep(0.1)


def test_without_the_key_a_stranger_gets_the_kv(make_pair):
    # Today's exposure, kept as a test so that the guard below is known to guard something.
    pair = make_pair(key=None)
    live_transfer(pair, "xfer-live")
    got = stranger(pair.sender.address, "xfer-live", "plain")
    assert got["written"] > 0 and any("DONE" in r for r in got["replies"]), got
    pair.receiver.apply_step(pulls=[pair.spec("d1", "xfer-live", [8, 9, 10, 11])])
    assert "closed" in (wait_done(pair.receiver, "d1") or "")  # and the victim's request fails


@pytest.mark.parametrize("mode", ["plain", "wrong-key"])
def test_a_stranger_without_the_key_gets_nothing_and_d_still_gets_its_kv(make_pair, mode, caplog):
    pair = make_pair()
    secret, commitment = new_binding()
    live_transfer(pair, "xfer-live", commitment)
    with caplog.at_level(logging.WARNING, logger="pdkv.auth"):
        got = stranger(pair.sender.address, "xfer-live", mode)
    assert got == {"replies": [], "written": 0}  # not one byte, not even an answer
    assert pair.sender.trace.auth_refused_total("unauthenticated") == 2  # its announcement and its pull
    assert caplog.text.count("dropped a frame from 127.0.0.1: unauthenticated") == 1  # logged once for both
    pair.receiver.apply_step(pulls=[pair.spec("d1", "xfer-live", [8, 9, 10, 11], secret)])
    assert wait_done(pair.receiver, "d1") is None
    assert_d_got_the_kv(pair, [2, 3, 4, 5], [8, 9, 10, 11])


def test_a_replayed_genuine_pull_is_dropped_and_d_still_gets_its_kv(make_pair, tmp_path):
    pair = make_pair()
    secret, commitment = new_binding()
    # D's pull reaches P before P has the transfer: it waits there, and its sealed frames are on the wire.
    pair.receiver.apply_step(pulls=[pair.spec("d1", "xfer-live", [8, 9, 10, 11], secret)])
    deadline = time.monotonic() + 5
    while len(pair.recorded) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    genuine = list(pair.recorded[:2])  # the announcement and the pull, byte for byte
    got = stranger(pair.sender.address, "xfer-live", "replay", tmp_path, frames=genuine)
    assert got == {"replies": [], "written": 0}
    assert pair.sender.trace.auth_refused_total("replayed") == 2
    live_transfer(pair, "xfer-live", commitment)
    assert wait_done(pair.receiver, "d1") is None
    assert_d_got_the_kv(pair, [2, 3, 4, 5], [8, 9, 10, 11])


def test_a_keyed_pull_without_the_binding_is_refused_and_the_transfer_stays_for_d(make_pair):
    # A peer that holds the deployment key but is not the D the proxy chose for this transfer.
    pair = make_pair()
    secret, commitment = new_binding()
    live_transfer(pair, "xfer-live", commitment)
    got = stranger(pair.sender.address, "xfer-live", "keyed", env={"PDKV_TOKEN": KEY})
    assert got["written"] == 0
    assert any("binding" in r and "ERROR" in r for r in got["replies"]), got
    pair.receiver.apply_step(pulls=[pair.spec("d1", "xfer-live", [8, 9, 10, 11], secret)])
    assert wait_done(pair.receiver, "d1") is None
    assert_d_got_the_kv(pair, [2, 3, 4, 5], [8, 9, 10, 11])


def test_a_pull_outside_ds_announced_regions_is_refused_before_any_byte_moves(make_pair):
    pair = make_pair()
    secret, commitment = new_binding()
    live_transfer(pair, "xfer-live", commitment)
    # Sealed by D itself, bound, for D's own session: only the block ids reach past what D announced.
    pair.receiver.apply_step(pulls=[pair.spec("d-bad", "xfer-live", [13, 14, 15, BLOCKS], secret)])
    why = wait_done(pair.receiver, "d-bad")
    assert why is not None and f"block id {BLOCKS} is outside the {BLOCKS} registered blocks" in why
    assert not pair.d_mem.any()
    pair.receiver.apply_step(pulls=[pair.spec("d1", "xfer-live", [8, 9, 10, 11], secret)])
    assert wait_done(pair.receiver, "d1") is None
    assert_d_got_the_kv(pair, [2, 3, 4, 5], [8, 9, 10, 11])
    untouched = [b for b in range(BLOCKS) if b not in (8, 9, 10, 11)]
    assert not pair.d_mem[:, untouched].any()

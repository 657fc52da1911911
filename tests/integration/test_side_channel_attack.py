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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.kv_pair import BLOCKS, KVHarness, Pair, assert_copied, wait_holding, wait_results
from support.waiting import wait_for

from pdkv.auth import FrameSealer, new_binding

KEY = "deployment-key-for-the-attack-test"
STRANGER = Path(__file__).with_name("stranger.py")
ROOT = Path(__file__).resolve().parents[2]


class RecordingSealer(FrameSealer):
    """D's sealer, keeping every frame it sealed as it left D."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.recorded: list[bytes] = []

    def seal(self, body: bytes, direction: bytes) -> bytes:
        out = super().seal(body, direction)
        self.recorded.append(out)
        return out


@pytest.fixture
def make_keyed_pair(kv: KVHarness) -> Callable[..., Pair]:
    """P and D of the attack, with the deployment key on both (None: neither); D's sealer a RecordingSealer."""

    def make(key: str | None = KEY) -> Pair:
        return kv.pair(liveness_s=5.0, p_sealer=FrameSealer(key) if key else None, d_sealer=RecordingSealer(key) if key else None)

    return make


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


def wait_done(pair: Pair, d_req: str) -> str | None:
    """The pull's error, or None once its KV arrived."""
    return wait_results(pair.receiver, {d_req}).failed.get(d_req)


def live_transfer(pair: Pair, tid: str, commitment: str = "") -> None:
    """P computed a prompt into blocks 2..5 and holds it for the transfer `tid`, bound to the D holding the secret."""
    pair.sender.apply_step(registered={"p1": tid}, bindings={tid: commitment} if commitment else None)
    pair.sender.apply_step(ready={"p1": (tid, [2, 3, 4, 5])})
    wait_holding(pair.sender, tid)


def test_without_the_key_a_stranger_gets_the_kv(make_keyed_pair):
    # Today's exposure, kept as a test so that the guard below is known to guard something.
    pair = make_keyed_pair(key=None)
    live_transfer(pair, "xfer-live")
    got = stranger(pair.sender.address, "xfer-live", "plain")
    assert got["written"] > 0 and any("DONE" in r for r in got["replies"]), got
    pair.receiver.apply_step(pulls=[pair.spec("d1", "xfer-live", [8, 9, 10, 11])])
    assert "closed" in (wait_done(pair, "d1") or "")  # and the victim's request fails


@pytest.mark.parametrize("mode", ["plain", "wrong-key"])
def test_a_stranger_without_the_key_gets_nothing_and_d_still_gets_its_kv(make_keyed_pair, mode, caplog):
    pair = make_keyed_pair()
    secret, commitment = new_binding()
    live_transfer(pair, "xfer-live", commitment)
    with caplog.at_level(logging.WARNING, logger="pdkv.auth"):
        got = stranger(pair.sender.address, "xfer-live", mode)
    assert got == {"replies": [], "written": 0}  # not one byte, not even an answer
    assert pair.sender.trace.auth_refused_total("unauthenticated") == 2  # its announcement and its pull
    assert caplog.text.count("dropped a frame from 127.0.0.1: unauthenticated") == 1  # logged once for both
    pair.receiver.apply_step(pulls=[pair.spec("d1", "xfer-live", [8, 9, 10, 11], binding=secret)])
    assert wait_done(pair, "d1") is None
    assert_copied(pair, [2, 3, 4, 5], [8, 9, 10, 11])


def test_a_replayed_genuine_pull_is_dropped_and_d_still_gets_its_kv(make_keyed_pair, tmp_path):
    pair = make_keyed_pair()
    secret, commitment = new_binding()
    # D's pull reaches P before P has the transfer: it waits there, and its sealed frames are on the wire.
    pair.receiver.apply_step(pulls=[pair.spec("d1", "xfer-live", [8, 9, 10, 11], binding=secret)])
    recorded = pair.receiver.sealer.recorded
    wait_for(lambda: len(recorded) >= 2, 5, "D to send its announcement and its pull")
    genuine = list(recorded[:2])  # the announcement and the pull, byte for byte
    got = stranger(pair.sender.address, "xfer-live", "replay", tmp_path, frames=genuine)
    assert got == {"replies": [], "written": 0}
    assert pair.sender.trace.auth_refused_total("replayed") == 2
    live_transfer(pair, "xfer-live", commitment)
    assert wait_done(pair, "d1") is None
    assert_copied(pair, [2, 3, 4, 5], [8, 9, 10, 11])


def test_a_keyed_pull_without_the_binding_is_refused_and_the_transfer_stays_for_d(make_keyed_pair):
    # A peer that holds the deployment key but is not the D the proxy chose for this transfer.
    pair = make_keyed_pair()
    secret, commitment = new_binding()
    live_transfer(pair, "xfer-live", commitment)
    got = stranger(pair.sender.address, "xfer-live", "keyed", env={"PDKV_TOKEN": KEY})
    assert got["written"] == 0
    assert any("binding" in r and "ERROR" in r for r in got["replies"]), got
    pair.receiver.apply_step(pulls=[pair.spec("d1", "xfer-live", [8, 9, 10, 11], binding=secret)])
    assert wait_done(pair, "d1") is None
    assert_copied(pair, [2, 3, 4, 5], [8, 9, 10, 11])


def test_a_pull_outside_ds_announced_regions_is_refused_before_any_byte_moves(make_keyed_pair):
    pair = make_keyed_pair()
    secret, commitment = new_binding()
    live_transfer(pair, "xfer-live", commitment)
    # Sealed by D itself, bound, for D's own session: only the block ids reach past what D announced.
    pair.receiver.apply_step(pulls=[pair.spec("d-bad", "xfer-live", [13, 14, 15, BLOCKS], binding=secret)])
    why = wait_done(pair, "d-bad")
    assert why is not None and f"block id {BLOCKS} is outside the {BLOCKS} registered blocks" in why
    assert not pair.d.mem.any()
    pair.receiver.apply_step(pulls=[pair.spec("d1", "xfer-live", [8, 9, 10, 11], binding=secret)])
    assert wait_done(pair, "d1") is None
    assert_copied(pair, [2, 3, 4, 5], [8, 9, 10, 11])
    untouched = [b for b in range(BLOCKS) if b not in (8, 9, 10, 11)]
    assert not pair.d.mem[:, untouched].any()

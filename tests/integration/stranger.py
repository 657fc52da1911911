"""A stranger process on P's network: it knows P's side-channel address and a live transfer_id, and asks
P for that transfer's KV into memory of its own, with pdkv's own protocol types.

    python stranger.py ADDR TRANSFER_ID MODE [FRAMES_HEX_FILE]

MODE: plain (no seal: the stranger lacks the key), wrong-key (sealed with a key of its own),
keyed (sealed with the deployment key from PDKV_TOKEN, but without the transfer's binding), replay
(send the frames in FRAMES_HEX_FILE, one hex frame a line, as they were recorded).
Prints one JSON line: the replies it got and how many bytes of its memory were written.
STRANGER_LAYOUT=REGIONS,BLOCK_LEN shapes its memory like the deployment's (default 3,512).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import zmq

from pdkv.auth import FrameSealer, token_from_env
from pdkv.wire import TO_D, TO_P, Announce, PullRequest, Region, decode_reply, encode
from pdkv.transport import open_transport

LAYERS, BLOCKS, BLOCK_LEN = 3, 16, 512


def main() -> None:
    addr, tid, mode = sys.argv[1:4]
    layers, block_len = (int(x) for x in os.environ.get("STRANGER_LAYOUT", f"{LAYERS},{BLOCK_LEN}").split(","))
    mem = np.zeros((layers, BLOCKS, block_len), np.uint8)
    with open_transport("tcp", "127.0.0.1", write_timeout_s=3.0) as t:
        t.register([(mem.ctypes.data, mem.nbytes)])
        regions = [Region(mem.ctypes.data + layer * BLOCKS * block_len, block_len, BLOCKS) for layer in range(layers)]
        announce = Announce(session=t.session_address, tp_rank=0, tp_size=1, regions=regions)
        pull = PullRequest(transfer_id=tid, d_req_id="stranger-1", session=t.session_address, tp_rank=0, tp_size=1,
                           block_ids=list(range(4)))
        frames = [encode(announce), encode(pull)]
        sealer = None
        if mode == "wrong-key":
            sealer = FrameSealer("not-the-deployment-key")
        elif mode == "keyed":
            sealer = FrameSealer(token_from_env() or "")
        if sealer is not None:
            frames = [sealer.seal(f, TO_P) for f in frames]
        if mode == "replay":
            frames = [bytes.fromhex(line) for line in open(sys.argv[4]).read().split()]
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        for f in frames:
            sock.send(f)
        replies: list[str] = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            if sock.poll(100):
                frame = sock.recv()
                if sealer is not None:
                    frame, _ = sealer.open(frame, TO_D)
                    if frame is None:
                        replies.append("unreadable")
                        continue
                msg = decode_reply(frame)
                status = getattr(getattr(msg, 'status', None), 'name', '')
                replies.append(f"{type(msg).__name__}:{status}:{getattr(msg, 'error', '')}")
        sock.close()
        ctx.term()
        print(json.dumps({"replies": replies, "written": int(np.count_nonzero(mem))}))


if __name__ == "__main__":
    main()

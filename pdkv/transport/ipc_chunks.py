"""CUDA IPC's pure half: address-span checks and translation, chunk planning.

No torch and no driver calls (numpy only), so it runs and is tested anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pdkv.errors import TransferError
from pdkv.transport.base import Descriptor

# Each kernel program copies one chunk; long descriptors are split so the
# grid keeps every SM busy whether the layout has 36 or 2,268 descriptors.
CHUNK_BYTES = 64 * 1024


class SpanMap:
    """Sorted, non-overlapping address spans, each mapped to where it lives in this process.

    `translate` maps whole ranges (vectorized) and refuses any range that does
    not lie inside a single span.
    """

    def __init__(self, spans: Sequence[tuple[int, int, int]]) -> None:
        import numpy as np

        ordered = sorted((s, e, m) for s, e, m in spans if e > s)
        for (_, a_end, _), (b_start, _, _) in zip(ordered, ordered[1:], strict=False):
            if b_start < a_end:
                raise TransferError(f"regions overlap at 0x{b_start:x}")
        table = np.array(ordered, dtype=np.int64).reshape(-1, 3)
        self._starts, self._ends, self._mapped = table[:, 0], table[:, 1], table[:, 2]

    def translate_many(self, addr, length, side: str):
        """Map int64 arrays of (addr, length) ranges; raise TransferError naming the first bad one."""
        import numpy as np

        i = np.searchsorted(self._starts, addr, side="right") - 1
        safe = np.clip(i, 0, max(len(self._starts) - 1, 0))
        if len(self._starts) == 0:
            ok = np.zeros(len(addr), dtype=bool)
        else:
            ok = (i >= 0) & (length > 0) & (addr + length <= self._ends[safe])
        if not ok.all():
            bad = int(np.argmin(ok))
            raise TransferError(f"{side} range 0x{int(addr[bad]):x}+{int(length[bad])} is outside the registered KV regions")
        return addr - self._starts[safe] + self._mapped[safe]

    def translate(self, addr: int, length: int, side: str) -> int:
        import numpy as np

        return int(self.translate_many(np.array([addr], dtype=np.int64), np.array([length], dtype=np.int64), side)[0])


def plan_chunks(descriptors: Sequence[Descriptor], local: SpanMap, remote: SpanMap, chunk: int = CHUNK_BYTES):
    """Check, translate and split descriptors into an int64 array of (src, dst, nbytes) rows, each at most `chunk` bytes.

    Raises TransferError before returning anything if one descriptor leaves
    the local or the remote regions, or is not 16-byte aligned.
    """
    import numpy as np

    if not descriptors:
        return np.zeros((0, 3), dtype=np.int64)
    d = np.array(msgspec.to_builtins(descriptors), dtype=np.int64).reshape(-1, 3)
    src, dst, length = d[:, 0], d[:, 1], d[:, 2]
    misaligned = (src | dst | length) % 16 != 0
    if misaligned.any():
        raise TransferError(f"descriptor {descriptors[int(np.argmax(misaligned))]} is not 16-byte aligned")
    s = local.translate_many(src, length, "local")
    t = remote.translate_many(dst, length, "remote")
    counts = -(-length // chunk)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(int(counts.sum()), dtype=np.int64) - first) * chunk
    length_rep = np.repeat(length, counts)
    out = np.empty((len(offset), 3), dtype=np.int64)
    out[:, 0] = np.repeat(s, counts) + offset
    out[:, 1] = np.repeat(t, counts) + offset
    out[:, 2] = np.minimum(chunk, length_rep - offset)
    return out


def block_array(blocks, num_blocks: int, side: str):
    """Block ids as int64, refusing any outside [0, num_blocks) before anything is copied."""
    import numpy as np

    arr = np.asarray(blocks)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise TransferError(f"{side} block ids must be a list of integers")
    arr = arr.astype(np.int64, copy=False)
    bad = (arr < 0) | (arr >= num_blocks)
    if bad.any():
        raise TransferError(f"{side} block id {int(arr[np.argmax(bad)])} is outside the {num_blocks} registered blocks")
    return arr

"""KV memory for the benchmark: one buffer per layer, on the host (numpy) or a GPU (torch), as the connector registers it.

numpy and torch are imported when a buffer is made, never at module import.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable
from typing import Any

from pdkv.errors import TransferError, UsageError
from pdkv.wire import Region


def parse_device(device: str) -> str:
    """'cpu' or 'cuda:N' (plain 'cuda' is 'cuda:0'); anything else is a usage error."""
    d = device.strip().lower()
    if d == "cpu":
        return "cpu"
    if d == "cuda":
        return "cuda:0"
    if d.startswith("cuda:") and d[5:].isdigit():
        return d
    raise UsageError(f"unknown memory device {device!r}", hint="use cpu or cuda:N")


class KVMemory:
    """`layers` buffers of `num_blocks * block_len` bytes each on `device`; block b of layer l is one block's K and V."""

    def __init__(self, device: str, layers: int, block_len: int, num_blocks: int) -> None:
        self.device = parse_device(device)
        self.layers, self.block_len, self.num_blocks = layers, block_len, num_blocks
        size = block_len * num_blocks
        self._buffers: list[Any] = []
        if self.device == "cpu":
            import numpy as np

            self._buffers = [np.empty(size, dtype=np.uint8) for _ in range(layers)]
            self._bases = [int(b.ctypes.data) for b in self._buffers]
        else:
            torch = _torch_cuda(self.device)
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(layers)]
            self._bases = [int(t.data_ptr()) for t in self._buffers]
        self._order = sorted(range(layers), key=lambda i: self._bases[i])
        self._sorted_bases = [self._bases[i] for i in self._order]

    @property
    def regions(self) -> list[Region]:
        return [Region(base, self.block_len, self.num_blocks) for base in self._bases]

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(address, length) of every buffer, for Transport.register."""
        return [(base, self.block_len * self.num_blocks) for base in self._bases]

    def fill(self, seed: int) -> None:
        """Fill every buffer with seeded random bytes (layer l from seed and l), so a misplaced block cannot look right."""
        if self.device == "cpu":
            import numpy as np

            for i, buf in enumerate(self._buffers):
                buf[:] = np.frombuffer(np.random.default_rng([seed, i]).bytes(buf.nbytes), dtype=np.uint8)
            return
        torch = _torch_cuda(self.device)
        for i, t in enumerate(self._buffers):
            gen = torch.Generator(device=self.device).manual_seed(seed * 100_003 + i)
            torch.randint(0, 256, t.shape, dtype=torch.uint8, device=self.device, generator=gen, out=t)
        torch.cuda.synchronize(self.device)

    def _locate(self, addr: int, length: int) -> tuple[int, int]:
        pos = bisect.bisect_right(self._sorted_bases, addr) - 1
        if pos >= 0:
            layer = self._order[pos]
            off = addr - self._bases[layer]
            if length > 0 and off + length <= self.block_len * self.num_blocks:
                return layer, off
        raise TransferError(f"range of {length} B at {addr:#x} lies outside the benchmark's {self.device} buffers")

    def digest(self, ranges: Iterable[tuple[int, int]]) -> str:
        """BLAKE2b of the bytes of (address, length) ranges, in order; every range must lie inside one buffer."""
        h = hashlib.blake2b(digest_size=32)
        for addr, length in ranges:
            layer, off = self._locate(addr, length)
            piece = self._buffers[layer][off : off + length]
            if self.device != "cpu":
                piece = piece.cpu().numpy()
            h.update(memoryview(piece))
        return h.hexdigest()

    def view(self, addr: int, length: int) -> Any:
        """The `length` bytes at `addr` as a slice of this memory's buffer (numpy array or torch tensor)."""
        layer, off = self._locate(addr, length)
        return self._buffers[layer][off : off + length]

    def view_at(self, layer: int, offset: int, length: int) -> Any:
        return self._buffers[layer][offset : offset + length]

    def flip(self, addr: int) -> None:
        """Invert the byte at `addr` (tests use it to corrupt what arrived)."""
        layer, off = self._locate(addr, 1)
        buf = self._buffers[layer]
        if self.device == "cpu":
            buf[off] ^= 0xFF
        else:
            buf[off] = 255 - buf[off]

    def close(self) -> None:
        self._buffers = []


def _torch_cuda(device: str) -> Any:
    try:
        import torch
    except ImportError:
        raise UsageError(f"{device} memory needs torch", hint="install torch with CUDA, or use --src/--dst cpu") from None
    index = int(device.split(":")[1])
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise UsageError(
            f"{device} asked for, but torch sees {torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices",
            hint="use --src/--dst cpu on a host without GPUs",
        )
    return torch

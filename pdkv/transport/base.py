"""The Transport protocol every KV transport implements, and the region types it moves between."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import msgspec

from pdkv.protocol import Address, BlockCount, Length, check_span


class Region(msgspec.Struct, frozen=True):
    """One registered KV region: `num_blocks` blocks of `block_len` bytes each, starting at `base`.

    For a blocks-contiguous layout a region is one layer's cache; layouts that
    keep K and V apart have two regions per layer. Block `b` occupies
    [base + b * block_len, base + (b + 1) * block_len).
    """

    base: Address  # bounded so a peer's regions decode (bench's Ready) only when they make sense
    block_len: Length
    num_blocks: BlockCount

    def __post_init__(self) -> None:
        check_span("region", self.base, self.block_len * self.num_blocks)

    @property
    def size(self) -> int:
        return self.block_len * self.num_blocks


class Descriptor(msgspec.Struct, frozen=True, array_like=True):
    """One write: `length` bytes from local address `src` to remote address `dst`."""

    src: int
    dst: int
    length: int


@runtime_checkable
class Transport(Protocol):
    """Moves bytes from this process's registered memory into a peer's.

    Implementations are context managers; `close()` releases everything.
    """

    @property
    def session_address(self) -> str:
        """What a peer passes to `write` to reach this process (e.g. "127.0.0.1:15432")."""
        ...

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register (address, length) memory ranges for transfer."""
        ...

    def unregister(self, regions: list[tuple[int, int]]) -> None:
        ...

    def write(self, peer: str, descriptors: list[Descriptor]) -> None:
        """Write every descriptor to `peer` and return once all bytes have landed; raise TransferError otherwise."""
        ...

    def close(self) -> None:
        ...


def write_blocks(
    transport: Transport,
    peer: str,
    local_blocks: list[int],
    remote_blocks: list[int],
    local_regions: list[Region],
    remote_regions: list[Region],
) -> int:
    """Copy `local_blocks` of every local region into `remote_blocks` of its remote twin; return the bytes moved.

    Transports that move whole blocks better than descriptor lists (the CUDA
    IPC kernel) provide their own `write_blocks`; the rest get the planner's
    coalesced descriptors. Every block id is bounds-checked either way.
    """
    own = getattr(transport, "write_blocks", None)
    if own is not None:
        return own(peer, local_blocks, remote_blocks, local_regions, remote_regions)
    from pdkv.transport.planner import plan_descriptors

    descriptors = plan_descriptors(local_blocks, remote_blocks, local_regions, remote_regions)
    transport.write(peer, descriptors)
    return sum(d.length for d in descriptors)

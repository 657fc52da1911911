"""The Transport protocol every KV transport implements, and the region types it moves between."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import msgspec

from pdkv.protocol import Address, BlockCount, Length, check_span

if TYPE_CHECKING:
    from pdkv.protocol import IpcExport


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


class Written(NamedTuple):
    """What one `write_blocks` moved: bytes, and the writes it took (coalesced descriptors, or (ipc) block copies)."""

    bytes: int
    descriptors: int


@runtime_checkable
class Transport(Protocol):
    """Moves bytes from this process's registered memory into a peer's: the one seam every caller uses.

    Implementations are context managers; `close()` releases everything.
    Every method may be called from several threads at once.
    """

    protocol: str

    @property
    def session_address(self) -> str:
        """What a peer passes to `write` to reach this process (e.g. "127.0.0.1:15432")."""
        ...

    @property
    def settings(self) -> dict[str, str]:
        """The transport's own settings in effect (Mooncake's MC_*), for reports."""
        ...

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register (address, length) memory ranges for transfer."""
        ...

    def unregister(self, regions: list[tuple[int, int]]) -> None:
        ...

    def hello(self) -> IpcExport | None:
        """What D sends P with every pull so that P can reach its memory (CUDA IPC handles), or None."""
        ...

    def connect(self, peer: str, hello: IpcExport | None) -> None:
        """Make `peer` writable from this process, given its `hello()`; cheap once done. TransferError if P and D
        use different transports."""
        ...

    def write(self, peer: str, descriptors: list[Descriptor]) -> None:
        """Write every descriptor to `peer` and return once all bytes have landed; raise TransferError otherwise."""
        ...

    def write_blocks(
        self, peer: str, local_blocks: list[int], remote_blocks: list[int], local_regions: list[Region], remote_regions: list[Region]
    ) -> Written:
        """Copy `local_blocks` of every local region into `remote_blocks` of its remote twin, every block id
        bounds-checked first; return once all bytes have landed, else raise TransferError."""
        ...

    def close(self) -> None:
        ...

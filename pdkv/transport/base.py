"""The Transport protocol every KV transport implements, and the region types it moves between."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import msgspec

from pdkv.wire import Region

__all__ = ["Descriptor", "Transport", "UncheckedWrites", "Written"]

if TYPE_CHECKING:
    from pdkv.wire import IpcExport
    from pdkv.tp_heads import HeadShare


class Descriptor(msgspec.Struct, frozen=True, array_like=True):
    """One write: `length` bytes from local address `src` to remote address `dst`."""

    src: int
    dst: int
    length: int


class Written(NamedTuple):
    """What one `write_blocks` moved: bytes, and the writes it took (coalesced descriptors, or (ipc) block copies)."""

    bytes: int
    descriptors: int


class UncheckedWrites:
    """`expect` and `forget` of a transport whose writes land in D's memory without D's part (Mooncake, cma, ipc):
    D has nothing to check them with. The socket transport, whose D receives every byte, checks."""

    def expect(self, transfer: str, ranges: list[tuple[int, int]]) -> None:
        pass

    def forget(self, transfer: str) -> None:
        pass


@runtime_checkable
class Transport(Protocol):
    """Moves bytes from this process's registered memory into a peer's: the one seam every caller uses.

    Implementations are context managers; `close()` releases everything.
    Every method may be called from several threads at once.
    """

    name: str  # how it moves KV (pdkv.transport.TransportName)

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

    def expect(self, transfer: str, ranges: list[tuple[int, int]]) -> None:
        """D: peers may write these (address, length) ranges of this process's registered memory under `transfer`
        until `forget(transfer)`. A transport whose writes D can check (socket) refuses any other write before a
        byte lands; the others write into D's memory without D's part (Mooncake, cma, ipc) and ignore it."""
        ...

    def forget(self, transfer: str) -> None:
        """D: no more writes under `transfer` (its pull concluded)."""
        ...

    def write(self, peer: str, descriptors: list[Descriptor], *, transfer: str = "") -> None:
        """Write every descriptor to `peer` (under `transfer`, what D expects) and return once all bytes have landed;
        raise TransferError otherwise."""
        ...

    def write_blocks(
        self, peer: str, local_blocks: list[int], remote_blocks: list[int], local_regions: list[Region], remote_regions: list[Region],
        heads: HeadShare | None = None, *, transfer: str = "",
    ) -> Written:
        """Copy `local_blocks` of every local region into `remote_blocks` of its remote twin, every block id
        bounds-checked first; with `heads` (P and D of different TP sizes) only that share of each block; under
        `transfer` (what D expects, see `expect`). Return once all bytes have landed, else raise TransferError."""
        ...

    def close(self) -> None:
        ...

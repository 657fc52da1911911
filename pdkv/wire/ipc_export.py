"""The CUDA IPC export: what D announces to P on one GPU host so P can open D's KV regions.

It travels inside the side channel's Announce (pdkv.wire.side_channel); pdkv.transport.cuda_ipc makes and
opens it, pdkv.transport.ipc_share hands its file-descriptor allocations over.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from pdkv.bounds import MAX_RANK, Address, Count, Length, check_span


class IpcRegion(msgspec.Struct, frozen=True, array_like=True):
    """One exported KV region: `length` bytes at `base` (exporter's address), inside allocation `alloc`."""

    alloc: Count  # index into IpcExport.allocations
    base: Address
    length: Length

    def __post_init__(self) -> None:
        check_span("ipc region", self.base, self.length)


class IpcAllocation(msgspec.Struct, frozen=True, array_like=True):
    handle: bytes  # cudaIpcMemHandle_t of the allocation; empty for one shared as a file descriptor
    base: Address  # allocation base in the exporter's address space
    size: Length
    fd: bool = False  # a CUDA VMM allocation, fetched as a file descriptor from the export's fd_server (fd_share)

    def __post_init__(self) -> None:
        check_span("ipc allocation", self.base, self.size)


class IpcExport(msgspec.Struct, frozen=True):
    """What D sends P once per layout so P can open D's KV regions."""

    host_id: str  # boot id + hostname: IPC works only inside one host (one kernel)
    pid: Annotated[int, msgspec.Meta(gt=0, le=4_194_304)]  # Linux's PID_MAX_LIMIT
    device: Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANK)]  # a CUDA device ordinal
    device_uuid: str
    allocations: list[IpcAllocation]
    regions: list[IpcRegion]
    # The exporting process's start time (pdkv.transport.host.process_start_time): P refuses a pid reused since.
    start_time: Annotated[int, msgspec.Meta(ge=0, le=2**62)]
    fd_server: Annotated[str, msgspec.Meta(max_length=100)] = ""  # abstract Unix socket of the `fd` allocations
    fd_token: Annotated[bytes, msgspec.Meta(max_length=32)] = b""

    def __post_init__(self) -> None:
        if any(a.fd for a in self.allocations) and (not self.fd_server or len(self.fd_token) != 32):
            raise ValueError("ipc allocations shared as file descriptors need fd_server and a 32-byte fd_token")
        # P indexes allocations by region.alloc while it holds opened handles: a bad index must not get there.
        for i, region in enumerate(self.regions):
            if region.alloc >= len(self.allocations):
                raise ValueError(f"ipc regions[{i}].alloc is {region.alloc}, but there are {len(self.allocations)} allocations")

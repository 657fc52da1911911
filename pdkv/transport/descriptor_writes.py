"""The part of the Transport seam shared by transports that move descriptor lists (Mooncake, cma, socket)."""

from __future__ import annotations

from typing import Any

from pdkv.errors import TransferError
from pdkv.transport.base import Descriptor, Region, Written
from pdkv.transport.descriptors import plan_descriptors
from pdkv.tp_heads import HeadShare


class DescriptorWrites:
    """`write_blocks` as plan_descriptors' coalesced descriptors handed to the transport's own `write`; no hello."""

    name: str

    def write(self, peer: str, descriptors: list[Descriptor], *, transfer: str = "") -> None:  # provided by the transport
        raise NotImplementedError

    def hello(self) -> None:
        return None

    def connect(self, peer: str, hello: Any) -> None:
        if hello is not None:
            raise TransferError(
                f"decode sent CUDA IPC handles, but this engine moves KV with {self.name}",
                hint="use the same mooncake_protocol on P and D",
            )

    def write_blocks(
        self, peer: str, local_blocks: list[int], remote_blocks: list[int], local_regions: list[Region], remote_regions: list[Region],
        heads: HeadShare | None = None, *, transfer: str = "",
    ) -> Written:
        descriptors = plan_descriptors(local_blocks, remote_blocks, local_regions, remote_regions, heads=heads)
        self.write(peer, descriptors, transfer=transfer)
        return Written(sum(d.length for d in descriptors), len(descriptors))

"""Live membership's wire: which engines serve a deployment now, and what the proxy must know to route to them.

A pdkv extension beside vLLM's `/register` and `/query` (pdkv.wire.bootstrap, which stay as they are): engines
running pdkv's connector put a `MemberRecord` with POST /pdkv/members and renew it within its lease (`ttl_s`);
POST /pdkv/members/leave (`LeaveRequest`) drops one at once; GET /pdkv/members lists the live ones
(`MembersResponse`). The proxy follows the list, so engines come and go without a proxy restart. The registry
that holds them, its server and its client are pdkv.bootstrap.

Several prefill engines may share one members registry: each one's side channels stay in its own vLLM-style
bootstrap table (`bootstrap_url`), whose DP ranks only it holds.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from pdkv.bounds import Rank, RankCount

Role = Literal["prefill", "decode"]
MemberId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Url = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Label = Annotated[str, msgspec.Meta(max_length=1024)]

# A lease shorter than this would expire between two renewals of a busy engine.
MIN_TTL_S = 1.0
MAX_TTL_S = 3600.0
DEFAULT_MEMBER_TTL_S = 15.0


class MemberRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One engine (one DP rank) of a deployment, as it registers itself.

    `url` is where the proxy sends it requests; `bootstrap_url` (prefill only)
    is where its side channels are registered, the `remote_bootstrap_addr` D
    is told. The rest is what a P and a D must agree on to be paired
    (`compat_key`), and where its KV cache events are published.
    """

    member_id: MemberId
    role: Role
    url: Url
    bootstrap_url: Url | None = None
    dp_rank: Rank = 0
    dp_size: RankCount = 1
    tp_size: RankCount = 1
    model: Label = ""
    block_size: Annotated[int, msgspec.Meta(ge=0)] = 0
    connector: Label = "pdkv"
    transport: Label = ""
    kv_events: Url | None = None
    kv_events_replay: Url | None = None
    ttl_s: Annotated[float, msgspec.Meta(ge=MIN_TTL_S, le=MAX_TTL_S)] = DEFAULT_MEMBER_TTL_S

    def __post_init__(self) -> None:
        if self.dp_rank >= self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} is not below dp_size {self.dp_size}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http://HOST:PORT, got {self.url!r}")
        if self.role == "prefill" and not self.bootstrap_url:
            raise ValueError("a prefill member needs bootstrap_url (where its side channels are registered)")

    def compat_key(self) -> tuple[str, int, int, str, str]:
        """What a P and a D must share to be paired: model, block size, TP, connector, transport."""
        return (self.model, self.block_size, self.tp_size, self.connector, self.transport)


class LeaveRequest(msgspec.Struct, frozen=True):
    member_id: MemberId


class MemberView(msgspec.Struct, frozen=True, kw_only=True):
    """A live member as GET /pdkv/members lists it: the record and how long its lease has left."""

    record: MemberRecord
    expires_in_s: float


class MembersResponse(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    members: list[MemberView]

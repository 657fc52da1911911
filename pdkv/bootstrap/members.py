"""The members registry's state: which engines hold a live lease (`MemberTable`), pure, the clock passed in.

The records, their lease and the messages of POST/GET /pdkv/members are pdkv.wire's (`MemberRecord`,
pdkv.wire.members); the server in front of this table is pdkv.bootstrap.server.
"""

from __future__ import annotations

from pdkv.wire import MemberRecord, MembersResponse, MemberView

MAX_MEMBERS = 4096  # a registry holds at most this many; a join beyond it is refused


class MemberTable:
    """Live members by id, each with a lease. Not thread-safe: one event loop owns it."""

    def __init__(self) -> None:
        self._members: dict[str, tuple[MemberRecord, float]] = {}  # id -> (record, expires at)
        self.version = 0

    def __len__(self) -> int:
        return len(self._members)

    def has(self, member_id: str) -> bool:
        return member_id in self._members

    def put(self, record: MemberRecord, now: float) -> bool:
        """Add or renew `record`; True if the membership changed (new member, or a changed record)."""
        old = self._members.get(record.member_id)
        self._members[record.member_id] = (record, now + record.ttl_s)
        if old is not None and old[0] == record:
            return False
        self.version += 1
        return True

    def leave(self, member_id: str) -> bool:
        if self._members.pop(member_id, None) is None:
            return False
        self.version += 1
        return True

    def expire(self, now: float) -> list[MemberRecord]:
        """Drop every member whose lease ran out; returns them."""
        gone = [rec for rec, until in self._members.values() if until <= now]
        for rec in gone:
            del self._members[rec.member_id]
        if gone:
            self.version += 1
        return gone

    def view(self, now: float) -> MembersResponse:
        self.expire(now)
        members = [MemberView(record=rec, expires_in_s=round(until - now, 3)) for rec, until in sorted(self._members.values(),
                   key=lambda item: (item[0].role, item[0].url, item[0].dp_rank))]
        return MembersResponse(version=self.version, members=members)

"""What the other sessions of a pool claim, kept per pool and snapshot so a decision reads it in
constant time.

A decision needs the sum of what the pool's other watched sessions hold and the growth their
plans promise, and their fair-share claims (planner.share_for). Scanned at every decision,
with 256 sessions in one pool it was most of a report's cost (0.1 ms of 0.16 in process), and
it grew with every session. The sums are taken once per pool and snapshot and then kept as each
session decides; what a session held is read as of the snapshot (SessionRecord.peak_held_at),
which its later reports do not change, so only its plan's part moves. Membership changes (a
session opens, ends, or moves pools) start the sums again.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

from memd.sessions import SessionRecord


class Neighbour(NamedTuple):
    held: int  # what it held when the snapshot was taken (SessionRecord.peak_held_at)
    predicted: Optional[float]  # the peak its plan predicts
    wanted: Optional[int]  # the peak it would plan for with the pool to itself

    @property
    def growth(self) -> int:
        """What its plan promises beyond what it held (not yet in the snapshot's usage)."""
        return max(0, int(self.predicted) - self.held) if self.predicted is not None else 0


def counts(session: SessionRecord, pool_name: Optional[str]) -> bool:
    """Whether a session's claims count against others in ``pool_name``: only those whose process
    the daemon watches (SessionRecord.local: on this host, its pid checked). What any other peer
    claims (another host, a pid it cannot check) is taken for its own plan only: one such
    session claiming 20 GB of fixed memory cut a real job's plan from 1034 to 58, four to 1.
    Their real use, where it is on this machine, is in the pool's free memory all the same."""
    return session.pool == pool_name and session.local


def neighbour(session: SessionRecord, at: float) -> Neighbour:
    return Neighbour(session.peak_held_at(at), session.predicted_peak_bytes, session.wanted_peak_bytes)


class Claims:
    """The watched sessions of one pool as of the snapshot taken ``at``, with running sums."""

    def __init__(self, at: float, version: int, sessions: Iterable[Tuple[int, Neighbour]] = ()):
        self.at, self.version = at, version
        self.members: Dict[int, Neighbour] = {}
        self.held = self.growth = self.upper = 0  # upper: the sum of max(held, wanted) where wanted is known
        self.unknown: Dict[int, int] = {}  # held, of those that do not know what they want yet
        for sid, claim in sessions:
            self.put(sid, claim)

    def put(self, sid: int, claim: Neighbour) -> None:
        self.drop(sid)
        self.members[sid] = claim
        self._count(claim, sid, 1)

    def drop(self, sid: int) -> None:
        claim = self.members.pop(sid, None)
        if claim is not None:
            self._count(claim, sid, -1)

    def _count(self, claim: Neighbour, sid: int, sign: int) -> None:
        self.held += sign * claim.held
        self.growth += sign * claim.growth
        if claim.wanted is None:
            if sign > 0:
                self.unknown[sid] = claim.held
            else:
                self.unknown.pop(sid, None)
        else:
            self.upper += sign * max(claim.held, claim.wanted)

    def others(self, sid: int) -> "Others":
        own = self.members.get(sid)
        if own is None:
            return Others(self, None, len(self.members), self.held, self.growth, self.upper)
        return Others(self, sid, len(self.members) - 1, self.held - own.held, self.growth - own.growth,
                      self.upper - (max(own.held, own.wanted) if own.wanted is not None else 0))


class Others(NamedTuple):
    """One session's view of its pool's claims: everyone's but its own."""
    claims: Claims
    own: Optional[int]  # its sid, when it is among the members
    number: int  # of the others
    held: int
    growth: int  # planner.reserved_growth: promised to the others, not yet in use
    upper: int  # sum of max(held, wanted) over the others that know what they want

    def unknown(self) -> List[int]:
        return [held for sid, held in self.claims.unknown.items() if sid != self.own]

    def listed(self) -> List[Neighbour]:
        return [claim for sid, claim in self.claims.members.items() if sid != self.own]


def gather(sessions: Iterable[SessionRecord], pool_name: Optional[str], at: float, version: int = -1) -> Claims:
    return Claims(at, version, ((s.sid, neighbour(s, at)) for s in sessions if counts(s, pool_name)))

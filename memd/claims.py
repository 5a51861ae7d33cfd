"""What the other sessions of a pool claim, kept per pool and snapshot so a decision reads it in
sums, not session by session.

A decision needs the sum of what the pool's other watched sessions hold, the growth their plans
promise, and their fair-share claims (planner.share_for). Scanned at every decision, with 256
sessions in one pool it was most of a report's cost, and it grew with every session. The sums
are taken once per pool and snapshot and then kept as each session decides; what a session held
is read as of the snapshot (SessionRecord.peak_held_at), which its later reports do not change,
so only its plan's part moves. Membership changes (a session opens, ends, or moves pools) start
the sums again.
"""
from __future__ import annotations

import bisect
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

from memd.sessions import SessionRecord


class Neighbour(NamedTuple):
    held: int  # what it holds in the pool now, in the pool's units (planner.use_now)
    predicted: Optional[float]  # the peak its plan predicts
    wanted: Optional[int]  # the peak it would plan for with the pool to itself

    @property
    def growth(self) -> int:
        """What its plan promises beyond what it holds now (not yet in the pool's usage): held and
        growth together are its claim, the most of its plan and its use. Counted from the largest
        peak it reported instead, a job between steps was counted as holding its peak, beside the
        pool's free memory that counted it as free: two jobs in a 3 GiB group were planned 3.72
        GiB together (tests/test_invariants.py)."""
        return max(0, int(self.predicted) - self.held) if self.predicted is not None else 0


def counts(session: SessionRecord, pool_name: Optional[str]) -> bool:
    """Whether a session's claims count against others in ``pool_name``: only those whose process
    the daemon watches (SessionRecord.local: on this host, its pid checked). What any other peer
    claims (another host, a pid it cannot check) is taken for its own plan only: one such
    session claiming 20 GB of fixed memory cut a real job's plan from 1034 to 58, four to 1.
    Their real use, where it is on this machine, is in the pool's free memory all the same."""
    return session.pool == pool_name and session.local


Use = Callable[[SessionRecord], Optional[int]]


def neighbour(session: SessionRecord, at: float, use: Optional[Use] = None) -> Neighbour:
    """A session's claim; ``use``: what it holds in the pool now (None where it is not read: the
    largest peak it reported, SessionRecord.peak_held_at)."""
    now = use(session) if use is not None else None
    return Neighbour(session.peak_held_at(at) if now is None else now, session.predicted_peak_bytes,
                     session.wanted_peak_bytes)


class Claims:
    """The watched sessions of one pool as of the snapshot taken ``at``, with running sums, and
    their fair-share claims sorted so that budget.fair_share's sum is read by bisection."""

    def __init__(self, at: float, version: int, sessions: Iterable[Tuple[int, Neighbour]] = ()):
        self.at, self.version = at, version
        self.members: Dict[int, Neighbour] = {}
        self.held = self.growth = 0
        # fair_share keeps each session max(held, min(wanted, equal)) (wanted None: no bound).
        # One that wants no more than it holds keeps what it holds (flat); for the others, sorted
        # helds and wanteds give the sum at any ``equal``: a bisection, then a sum of a slice.
        self.flat = 0
        self.helds: List[int] = []  # of the sessions that want more than they hold
        self.wanteds: List[int] = []  # of those among them whose wanted is known
        for sid, claim in sessions:
            self.put(sid, claim)

    def put(self, sid: int, claim: Neighbour) -> None:
        self.drop(sid)
        self.members[sid] = claim
        self._count(claim, 1)

    def drop(self, sid: int) -> None:
        claim = self.members.pop(sid, None)
        if claim is not None:
            self._count(claim, -1)

    def _count(self, claim: Neighbour, sign: int) -> None:
        self.held += sign * claim.held
        self.growth += sign * claim.growth
        if not _grows(claim):
            self.flat += sign * claim.held
            return
        if sign > 0:
            bisect.insort(self.helds, claim.held)
            if claim.wanted is not None:
                bisect.insort(self.wanteds, claim.wanted)
        else:
            del self.helds[bisect.bisect_left(self.helds, claim.held)]
            if claim.wanted is not None:
                del self.wanteds[bisect.bisect_left(self.wanteds, claim.wanted)]

    def kept(self, equal: int) -> int:
        """Sum over the members of max(held, min(wanted, equal)): what budget.fair_share leaves
        them, by bisection and two sums over slices in C, where a Python sum over the members
        was most of a decision. Prefix sums, made again after every decision's own claim moved
        (each decision asks once), cost more than the slices (integers: the same sum either way)."""
        below = bisect.bisect_left(self.helds, equal)  # they hold less than an equal share: they may grow to it
        capped = bisect.bisect_right(self.wanteds, equal)  # they want no more than it: what they want
        return self.flat + sum(self.helds[below:]) + equal * (below - capped) + sum(self.wanteds[:capped])

    def others(self, sid: int) -> "Others":
        own = self.members.get(sid)
        if own is None:
            return Others(self, None, len(self.members), self.held, self.growth)
        return Others(self, own, len(self.members) - 1, self.held - own.held, self.growth - own.growth)


def _grows(claim: Neighbour) -> bool:
    return claim.wanted is None or claim.wanted > claim.held


class Others(NamedTuple):
    """One session's view of its pool's claims: everyone's but its own."""
    claims: Claims
    own: Optional[Neighbour]  # its own claim, when it is among the members
    number: int  # of the others
    held: int
    growth: int  # promised to the others, not yet in use: held back from this one's budget

    def kept(self, equal: int) -> int:
        """budget.fair_share's sum over the others."""
        kept = self.claims.kept(equal)
        if self.own is not None:
            own = self.own
            kept -= max(own.held, equal if own.wanted is None else min(own.wanted, equal))
        return kept

    def listed(self) -> List[Neighbour]:
        own = self.own
        listed = list(self.claims.members.values())
        if own is not None:
            listed.remove(own)
        return listed


def gather(sessions: Iterable[SessionRecord], pool_name: Optional[str], at: float, version: int = -1,
           use: Optional[Use] = None) -> Claims:
    return Claims(at, version, ((s.sid, neighbour(s, at, use)) for s in sessions if counts(s, pool_name)))

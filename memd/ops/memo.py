"""A session's decision, made by the policy once per change of what it depends on."""
from __future__ import annotations

from memd.core import Core
from memd.planner import plan_session
from memd.policy.controller import Decision
from memd.sampling.snapshot import Snapshot
from memd.sessions import SessionRecord


class NotReady(RuntimeError):
    """The daemon has not taken its first sample yet."""


def decide(core: Core, session: SessionRecord) -> Decision:
    """plan_session, memoised until one of its inputs changes.

    A decision is a pure function of the published snapshot, pressure, job trees, config and
    the sessions (every change to one, a new plan included, bumps ``core.epoch``), and deciding
    again on its own output state is a fixed point; so a repeated ``plan`` costs a few identity
    checks, not a policy run. The memo is ``session.decided``, written here only.
    """
    key = (snapshot(core), core.pressure, core.jobs, core.config, core.epoch)
    cached = session.decided
    if cached is not None and all(a is b for a, b in zip(cached[0], key)):
        return cached[1]
    previous = session.plan
    decision = plan_session(session, key[0], key[1].level, core.sessions, key[2], key[3].policy)
    if decision.plan != previous:
        core.epoch += 1  # the pool's other sessions reserve this one's growth: they decide again
    session.decided = (key[:4] + (core.epoch,), decision)
    return decision


def snapshot(core: Core) -> Snapshot:
    """The latest sample of the machine; NotReady before the first."""
    if core.snapshot is None:
        raise NotReady("the daemon has not sampled the machine yet")
    return core.snapshot

"""A session's decision, made by the policy once per change of what it depends on."""
from __future__ import annotations

import structlog

from memd.core import Core
from memd.ops.daemon_ops import workers_view
from memd.planner import plan_session
from memd.policy.controller import Decision
from memd.sampling.snapshot import Snapshot
from memd.sessions import SessionRecord

log = structlog.get_logger("memd.ops")


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
    mark_kills(session, key[0], key[2])
    if decision.plan != previous:
        core.epoch += 1  # the pool's other sessions reserve this one's growth: they decide again
        if previous is not None and decision.plan.batch_size != previous.batch_size:
            _log_change(core, session, previous.batch_size, decision)
    session.decided = (key[:4] + (core.epoch,), decision)
    return decision


def mark_kills(session: SessionRecord, snap: Snapshot, jobs) -> None:
    """The OOM killer's counts as of this decision, in the job's group (one with a limit: the
    pool that would kill it) and on the host, for lifecycle.killed_batch; before its first read,
    in the group read at its hello."""
    if not session.local:
        return
    job = jobs.get(session.pid)
    if job is not None and not job.alive:
        return
    cg = job.cgroup if job is not None else session.cgroup
    if cg is None or cg.limit_bytes is None:
        session.kill_marks = (None, 1, None, snap.oom_kills)
    else:
        session.kill_marks = (cg.path, cg.version, cg.oom_kill_events, snap.oom_kills)


def snapshot(core: Core) -> Snapshot:
    """The latest sample of the machine; NotReady before the first."""
    if core.snapshot is None:
        raise NotReady("the daemon has not sampled the machine yet")
    return core.snapshot


def _log_change(core: Core, session: SessionRecord, was: int, decision: Decision) -> None:
    """A change of batch, with what it was decided on: the journal is where an operator asks
    why a job moved (a loop that rebuilds its loader pays for each move)."""
    held = core.plan_log.allow()
    if held is not None:
        log.info("batch_changed", session=session.sid, job=session.job, pid=session.pid,
                 batch_size=decision.plan.batch_size, previous_batch_size=was, reason=decision.plan.reason,
                 budget_bytes=decision.budget_bytes, pool_budget_bytes=decision.pool_budget_bytes,
                 latest_peak_bytes=session.latest_peak, latest_batch=session.latest_batch,
                 workers=workers_view(session.workers), held_back=held)

"""The ops that need no session: the daemon's view (status, ping) and what it remembers for the
jobs' next runs (curves, forget)."""
from __future__ import annotations

from typing import Any, Dict, Optional

from memd import curves as learned
from memd import pages, visibility
from memd.client import protocol
from memd.client.counts import whole
from memd.core import VERSION, Core
from memd.ops.fields import Invalid, integer, text
from memd.policy.controller import WorkerFacts
from memd.sampling.snapshot import as_json
from memd.sessions import SessionRecord
from memd.state import MAX_KEY_CHARS, owner_of
from memd.visibility import EVERYONE, Viewer

Result = Dict[str, Any]


def status(core: Core, req: Dict[str, Any], who: Viewer = EVERYONE) -> Result:
    """The daemon's view of the machine and its sessions (no tokens), the sessions a page at a
    time as `curves` pages (memd.pages): 255 of them were a 187 KB reply. Only the sessions
    ``who`` may see (memd.visibility) are listed and counted.

    Request: optional after (int: the previous page's next), limit (int in [1, 4096]: sessions
    a page holds at most). Reply: version, host, uptime_seconds, pressure_level, snapshot (the
    `memd sample --json` fields), total (sessions open), next (the session number to ask for
    the next page with, or null on the last), sessions (by session number, those after
    ``after`` that fit in the page): [{session (its number, as in metrics and logs), job, pid,
    host, rank, pool, reports, ooms,
    latest_batch, latest_peak_bytes, budget_bytes, pool_budget_bytes (the budget and its workers'
    share), predicted_peak_bytes, ceiling, plan, pool_key (what
    its curve is remembered under; null while its GPU cannot be told), unwatched (why a job on
    this host is not measured here, or null), pod_uid, slurm_job_id (the Kubernetes pod and
    Slurm job it runs in, or null), attributed_by ("cgroup" or "environ": read by the daemon
    from the job's process; "client": as its hello said; null), workers (its dataloader workers
    as its last plan saw them, or null: workers_view)}].
    """
    after, limit = _cursor(req), integer(req, "limit")
    snapshot = core.snapshot
    reply: Result = {
        "version": VERSION,
        "host": core.host,
        "uptime_seconds": round(core.uptime(), 3),
        "pressure_level": core.pressure.level,
        "snapshot": as_json(snapshot) if snapshot is not None else None,
    }
    everyone = [s for s in core.sessions if visibility.sees_session(who, s)]  # by session number
    following = [s for s in everyone if after is None or s.sid > after]
    budget = pages.PAGE_BYTES - len(protocol.encode(reply))  # the page's header is part of its bytes
    shown = pages.fill((session_view(s) for s in following), budget, limit)
    more = len(shown) < len(following)
    return dict(reply, sessions=shown, total=len(everyone), next=shown[-1]["session"] if more else None)


def _cursor(req: Dict[str, Any]) -> Optional[int]:
    """status's after: a session number, as a reply's next gives it."""
    after = req.get("after")
    if after is not None and not (whole(after) and 0 <= after < 2 ** 63):
        raise Invalid("after must be a session number, an integer in [0, 2**63 - 1] (a reply's next)")
    return after


def ping(core: Core, req: Dict[str, Any]) -> Result:
    """Liveness. Request: nothing. Reply: pong (true), version, uptime_seconds."""
    return {"pong": True, "version": VERSION, "uptime_seconds": round(core.uptime(), 3)}


def curves(core: Core, req: Dict[str, Any], who: Viewer = EVERYONE) -> Result:
    """What the daemon remembers for the jobs' next runs (`memd curves`), one page at a time.

    Request: optional after ([job, pool], the previous page's next), limit (int in [1, 4096]:
    curves a page holds at most). Reply: curves ([{job, pool, owner,
    points: [[batch, peak_bytes], ...] (oldest first), ceiling (int or null), updated (unix
    seconds)}], by job then pool), total (entries remembered that the asker may see), next
    ([job, pool] to ask for the next page with, or null on the last). A reply stays within
    MAX_MESSAGE_BYTES (memd.curves). Only the curves ``who`` may see (memd.visibility) are listed.
    """
    after = req.get("after")
    if after is not None and not (isinstance(after, list) and len(after) == 2 and all(
            isinstance(v, str) and len(v) <= MAX_KEY_CHARS for v in after)):
        raise Invalid("after must be [job, pool], two strings of at most %d characters (a reply's next)"
                      % MAX_KEY_CHARS)
    keys = core.store.keys()
    if not who.admin:
        keys = [k for k in keys if visibility.sees_curve(who, owner_of(k[1]))]
    return learned.page(keys, core.store.recall, after, limit=integer(req, "limit"))


def forget(core: Core, req: Dict[str, Any], who: Viewer = EVERYONE) -> Result:
    """Forget what was learned for a job, in every pool or one (`memd forget`); written to the
    state file at once. Whoever may connect may call it: they could as well teach the job's
    curve anything with hello and report (docs/protocol.md, "Who may forget"); but a client
    admitted by its CURVE key forgets only that key's curves and sessions, since it can teach
    no other's, and a local peer other than root (memd.visibility) only what it may see: curves
    and sessions not kept under a key.

    Request: job (str of 1 to 128 characters), optional pool (a pool key as `curves` shows it).
    Reply: forgotten (curves dropped), sessions (live sessions of the job, in that pool, whose
    learning until now will not be remembered; their plans are unchanged), saved (false: the
    state file could not be written, the daemon logged why and retries at its next flush).
    """
    job = text(req, "job", required=True, limit=128)
    pool = text(req, "pool", limit=MAX_KEY_CHARS)
    if not job:
        raise Invalid("job must not be empty")
    if pool == "":
        raise Invalid("pool must not be empty (leave it out to forget every pool)")
    acting = who._replace(admin=False) if who.key is not None else who  # a key acts as that key, even root's
    dropped = core.store.forget(job, pool, mine=None if acting.admin else lambda o: visibility.sees_curve(acting, o))
    sessions = [s for s in core.sessions if s.job == job and (pool is None or s.pool_key == pool)
                and visibility.sees_session(acting, s)]
    for session in sessions:
        session.forget_learned()
    return {"forgotten": len(dropped), "sessions": len(sessions), "saved": core.store.flush()}


def session_view(s: SessionRecord) -> Result:
    """One session as `status` shows it."""
    return {
        "session": s.sid, "job": s.job, "pid": s.pid, "host": s.host, "rank": s.rank, "pool": s.pool,
        "pool_key": s.pool_key,
        "reports": s.reports, "ooms": s.ooms, "latest_batch": s.latest_batch,
        "latest_peak_bytes": s.latest_peak, "budget_bytes": s.budget_bytes, "pool_budget_bytes": s.pool_budget_bytes,
        # A plan held far past its curve (its GPU not known) predicted 2**71: more than msgpack carries
        "predicted_peak_bytes": (min(int(s.predicted_peak_bytes), 2 ** 63 - 1)
                                 if s.predicted_peak_bytes is not None else None),
        "ceiling": s.state.ceiling, "plan": s.plan.to_wire() if s.plan is not None else None,
        "unwatched": s.unwatched, "pod_uid": s.pod_uid, "slurm_job_id": s.slurm_job_id,
        "attributed_by": s.attributed_by, "workers": workers_view(s.workers),
        "cgroup_pressure_level": s.planner.group_pressure.level,  # in the job's own cgroup (planner.group_level)
    }


def workers_view(w: Optional[WorkerFacts]) -> Optional[Result]:
    """A session's dataloader workers as its last plan saw them: what a cut or a held growth
    beside them was decided on (a loop that rebuilds its loader starts them over)."""
    if w is None:
        return None
    return {"running": w.running if w.running is not None else len(w.uss), "own_bytes": list(w.uss),
            "cost_bytes": w.cost, "evident_bytes": w.evident, "growth_bytes": w.growth,
            "copying_bytes": w.copying, "queued_bytes": w.queued, "level_bytes": w.level, "levelled": w.levelled,
            "follows_plan": w.follows}

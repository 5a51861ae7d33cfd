"""How a session ends, however it ends, and what it leaves for its job's next run."""
from __future__ import annotations

import os
from typing import Optional

import structlog

from memd.core import Core
from memd.policy.controller import after_oom
from memd.sampling import cgroup as cgroups
from memd.sessions import SessionRecord
from memd.state import Memory, split_owner

log = structlog.get_logger("memd.ops")


def end(core: Core, session: SessionRecord, why: str) -> None:
    """What ending a session means, however it ends ("bye"; "expired": silent past the ttl or its
    process gone, found by housekeeping or by a hello that needed the room; "killed": its process
    ended by the kernel's OOM killer (learn_kill); "evicted": its slot
    given to another user's job, Sessions.crowding): the other
    sessions of its pool decide again, and what it learned is kept for the job's next run.
    Expired at a hello, sessions were once dropped unremembered and uncounted."""
    core.epoch += 1
    remember(core, session)
    if why != "bye":
        core.sessions_expired += 1
    held = core.session_log.allow()  # once per session (a repeated bye finds none), a flood rate-limited
    if held is not None:
        log.info("session_closed", session=session.sid, job=session.job, pid=session.pid, reason=why,
                 seconds=round(core.clock() - session.created, 1), reports=session.reports, ooms=session.ooms,
                 held_back=held)


def expire(core: Core) -> None:
    """End the sessions that are over (Sessions.expire); one whose process the OOM killer ended
    first learns it (learn_kill)."""
    for session in core.sessions.expire():
        killed = killed_batch(core, session)
        if killed is not None:
            learn_kill(core, session, killed)
        end(core, session, "expired" if killed is None else "killed")


def killed_batch(core: Core, session: SessionRecord, bye: bool = False) -> Optional[int]:
    """The batch a watched job was running when the kernel's OOM killer ended it (or one of its
    processes, ``bye``: a loop whose DataLoader worker was killed raises and says bye), or None.
    Its process is gone (or it says bye), and since its latest decision the OOM killer's count in
    its cgroup rose (v1 memory.oom_control, v2 memory.events: read by the group's path, which
    outlives the job), or, where the group cannot be read or has no limit, the host's
    (/proc/vmstat oom_kill), with a process of its tree gone. The batch is its plan's, the one it
    was told to run."""
    marks, plan = session.kill_marks, session.plan
    if not session.local or marks is None or plan is None or (not bye and core.sessions.alive(session)):
        return None
    path, version, group_kills, host_kills = marks
    now = cgroups.read_oom_kills(path, version, core.proc_root) if path is not None else None
    if now is not None and group_kills is not None:
        return plan.batch_size if now > group_kills else None
    snapshot = core.snapshot
    host_now = snapshot.oom_kills if snapshot is not None else None
    if host_now is not None and host_kills is not None and host_now > host_kills and (not bye or _lost(core, session)):
        return plan.batch_size
    return None


def _lost(core: Core, session: SessionRecord) -> bool:
    """A process of the job's tree, as last read, is gone."""
    job = core.jobs.get(session.pid)
    return job is not None and any(not os.path.exists(os.path.join(core.proc_root, str(p.pid))) for p in job.processes)


def learn_kill(core: Core, session: SessionRecord, batch: int) -> None:
    """A kill is an out-of-memory at ``batch``: the session's ooms, its ceiling (remembered for the
    job's next run, with its cause, never lifted by clean runs: SessionRecord.learned), the
    counter metric, a warning. Closed as "expired" with ooms 0, a killed job's next run started
    at the same default and was killed again, six times in a row."""
    session.ooms += 1
    core.kills_learned += 1
    session.state = after_oom(session.state, batch, session.limits, core.config.policy)
    session.ceiling_cause = "kill"
    held = core.oom_log.allow()
    if held is not None:
        log.warning("oom_kill_learned", session=session.sid, job=session.job, pid=session.pid, batch_size=batch,
                    ceiling=session.state.ceiling, pool=session.pool, pod_uid=session.pod_uid,
                    slurm_job_id=session.slurm_job_id, held_back=held)


def remember(core: Core, session: SessionRecord) -> None:
    """Keep a session's observations (and OOM ceiling, with the clean runs at it) for the job's
    next run, under the key its hello looked them up with (planner.identify); only what it
    learned since its job was last forgotten (SessionRecord.learned). Written again at each flush
    while it runs: each write is the whole of this run's learning, so none counts twice.
    Only a session whose process the daemon watches (local: on this host, its pid checked)
    writes: one report under the name `llama-ft` from elsewhere replaced that job's curve (its
    next run: batch 1 instead of 528), and 512 junk names evicted every curve. A session that
    came with an allow-listed CURVE key (a remote job) writes too, under that key alone: what
    it reports may be anything, but it can only teach its own key's curves (planner.ownership)."""
    if not session.local and session.key is None:
        return  # what it reported cannot be told from a forgery: planned by, never kept
    observations, ceiling, clean_runs = session.learned(core.config.policy.stable_steps)
    if session.pool_key is None or (not observations and ceiling is None and session.inherited_ceiling is None):
        return
    core.store.remember(session.job, session.pool_key, observations, ceiling, clean_runs, session.ceiling_cause)


def recall(core: Core, session: SessionRecord) -> Optional[Memory]:
    """What earlier runs of the session's job left under its key; else, for a local job memd
    now knows the owning user of, what an earlier memd kept before keys had owners (read, never
    written: its next save is its owner's). A CURVE key's session reads its key's curves only:
    an ownerless curve was a local job's."""
    if session.pool_key is None:
        return None
    memory = core.store.recall(session.job, session.pool_key)
    if memory is None and session.owner is not None and session.key is None:
        memory = core.store.recall(session.job, split_owner(session.pool_key)[0])
    return memory

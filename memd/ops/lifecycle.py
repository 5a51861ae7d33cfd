"""How a session ends, however it ends, and what it leaves for its job's next run."""
from __future__ import annotations

from typing import Optional

import structlog

from memd.core import Core
from memd.sessions import SessionRecord
from memd.state import Memory, split_owner

log = structlog.get_logger("memd.ops")


def end(core: Core, session: SessionRecord, why: str) -> None:
    """What ending a session means, however it ends ("bye"; "expired": silent past the ttl or its
    process gone, found by housekeeping or by a hello that needed the room; "evicted": its slot
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
    """End the sessions that are over (Sessions.expire)."""
    for session in core.sessions.expire():
        end(core, session, "expired")


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
    core.store.remember(session.job, session.pool_key, observations, ceiling, clean_runs)


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

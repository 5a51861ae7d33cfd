"""The protocol's operations: one handler per op, its docstring the wire specification.

Each handler takes the Core and the decoded request map and returns the ``result`` map; it
raises Invalid for a bad field and lets UnknownSession / TooManySessions through. Only the
server adds the envelope (v, id, ok) and maps exceptions to error codes (docs/protocol.md).
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple, overload

import structlog

from memd import attribution
from memd import curves as learned
from memd.client import protocol
from memd.client.counts import at_least, whole
from memd.core import VERSION, Core
from memd.planner import check_remembered, identify, plan_session, prior_from_hints
from memd.policy.budget import HOST, job_pids
from memd.policy.controller import ControlState, Limits, after_oom, after_report
from memd.policy.fit import Observation
from memd.sampling import cgroup as cgroups
from memd.sampling import procs
from memd.sampling.snapshot import Cgroup, as_json
from memd.sessions import OWNER, Peer, SessionRecord, TooManySessions
from memd.state import MAX_KEY_CHARS, Memory

Result = Dict[str, Any]

log = structlog.get_logger("memd.ops")


class Invalid(ValueError):
    """A request field is missing, of the wrong type, or out of range."""


class NotReady(RuntimeError):
    """The daemon has not taken its first sample yet."""


def hello(core: Core, req: Dict[str, Any], peer: Optional[Peer] = None) -> Result:
    """Register a job.

    Request: job (str), pid (int), host (str), min_batch (int >= 1); optional max_batch,
    default_batch, target_effective_batch (int >= 1), rank, local_rank (int >= 0), world_size,
    local_world_size (int >= 1), cpus (number: CPUs the client may run on), device (str, e.g.
    "cuda:0"), device_uuid (str), cuda_visible_devices (str), hints (map of scalars:
    num_workers, prefetch_factor, fixed_bytes, per_sample_bytes, ...; a number outside its
    protocol.HINT_RANGES range is ignored), nonce (str of 16 to 64 characters: the client
    Session's own secret; a hello whose nonce, pid and host match an open session's is
    answered with that session, its token and plan, so a retry after a lost reply opens no
    second session), pid_ns (int: the inode of the client's /proc/self/ns/pid) and start_time
    (int: its start in clock ticks since boot, field 22 of /proc/self/stat): when given, the
    pid is watched only if they match the daemon's own pid namespace and that pid's start
    (_local); a job on this host that fails them is planned from its reports, and says why.
    batch_size (int: the batch the job runs now, sent by a client saying hello again because
    the daemon restarted): its plan holds that batch until the daemon has read the job's
    memory, rather than budget a running job as if its memory were someone else's.
    pod_uid (str: the UID of the Kubernetes pod it runs in) and slurm_job_id (str of digits):
    where the daemon can read the job's process it attributes the session itself (cgroup path,
    then environment: memd.attribution) and these are ignored; else they are shown as told.
    Reply: token (str, needed by every later op of this session), plan, session_ttl (seconds).
    Every number within its protocol.FIELD_RANGES range.

    ``peer``: who asked, in the kernel's word (the ipc socket's credentials; None over TCP). A
    pid that belongs to another user than the one asking is not watched (_local), and when
    every slot is taken a user holding fewer sessions takes the newest of the user holding the
    most (Sessions.crowding).
    """
    limits = Limits(
        min_batch=_int(req, "min_batch", default=1),
        max_batch=_int(req, "max_batch"),
        default_batch=_int(req, "default_batch"),
        target=_int(req, "target_effective_batch"),
    )
    if limits.max_batch is not None and limits.max_batch < limits.min_batch:
        raise Invalid("max_batch %d is below min_batch %d" % (limits.max_batch, limits.min_batch))
    if limits.target is not None and limits.target < limits.min_batch:
        raise Invalid("target_effective_batch %d is below min_batch %d" % (limits.target, limits.min_batch))
    hints = req.get("hints") or {}
    if not isinstance(hints, dict) or len(hints) > 64 or not all(
            isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str))) for k, v in hints.items()):
        raise Invalid("hints must be a map of at most 64 scalars")
    hints, ignored = _bounded_hints(hints)
    limits = Limits(limits.min_batch, limits.max_batch, limits.default_batch, limits.target,
                    num_workers=at_least(hints.get("num_workers"), 0),
                    prefetch_factor=at_least(hints.get("prefetch_factor"), 1))
    pid = _int(req, "pid", required=True)
    rank, world_size = _int(req, "rank"), _int(req, "world_size")
    if rank is not None and world_size is not None and rank >= world_size:
        raise Invalid("rank %d is not below world_size %d" % (rank, world_size))
    _int(req, "local_rank")
    host = _str(req, "host", required=True, limit=255)
    job = _str(req, "job", required=True, limit=128)
    nonce = _str(req, "nonce", limit=64)
    if nonce is not None and len(nonce) < 16:
        raise Invalid("nonce must be a string of 16 to 64 characters")
    running = _int(req, "batch_size")  # checked, like every field, before anything changes
    told = attribution.told(_matching(req, "pod_uid", protocol.POD_UID), _matching(req, "slurm_job_id",
                                                                                   protocol.SLURM_JOB_ID))
    local, unwatched = _local(core, host, pid, _int(req, "pid_ns"), _int(req, "start_time"), peer)
    snapshot = _snapshot(core)
    earlier = core.sessions.find(host, pid, nonce) if nonce is not None else None
    if earlier is not None:  # the same client Session again: its earlier hello's reply was lost
        if earlier.job != job:
            raise Invalid("this nonce belongs to a session of another job")
        return {"token": earlier.token, "plan": _decide(core, earlier).plan.to_wire(),
                "session_ttl": core.config.session_ttl}
    found = attribution.read(pid, core.proc_root) if local else None
    found = told if found is None else found  # what the daemon can read wins over what it is told
    fields = dict(
        pod_uid=found.pod_uid, slurm_job_id=found.slurm_job_id, attributed_by=found.source,
        job=job, nonce=nonce, pid=pid, host=host, local=local, cgroup=_job_cgroup(core, pid) if local else None,
        start_time=procs.process_start_time(pid, core.proc_root) if local else None, limits=limits,
        rank=rank, world_size=world_size,
        device=_str(req, "device", limit=64), device_uuid=_str(req, "device_uuid", limit=96),
        visible_devices=_str(req, "cuda_visible_devices", limit=256), hints=dict(hints),
        prior=prior_from_hints(hints), cpus=_number(req, "cpus") or None,
        local_world_size=_int(req, "local_world_size"), unwatched=unwatched,
        peer_uid=None if peer is None else peer.uid,
    )
    try:
        session = core.sessions.open(**fields)
    except TooManySessions:  # all slots, or the unwatched share, taken: the dead make room
        expire(core)  # and are remembered and counted as ever
        if core.sessions.full():
            crowded = core.sessions.crowding(None if peer is None else peer.uid)
            if crowded is not None:  # one user's flood gives way to another user's job
                core.sessions.close(crowded.token)
                end(core, crowded, "evicted")
        session = core.sessions.open(**fields)
    held = core.log_throttle.allow("hints") if ignored else None  # a peer may repeat it: a line a minute at most
    if held is not None:
        log.warning("hints_ignored", job=session.job, session=session.sid, reasons=ignored,
                    held_back=held)
    core.epoch += 1
    session.owner = procs.process_owner(pid, core.proc_root) if local else None
    session.pool_key = identify(session, snapshot, core.config.policy)
    memory = _recall(core, session)
    if memory is not None:
        session.remembered = list(memory.observations)
        if memory.ceiling is not None:  # an earlier run ran out of memory above it: start below
            session.state = ControlState(ceiling=max(limits.min_batch, memory.ceiling),
                                         stable=core.config.policy.stable_steps)
            session.inherited_ceiling, session.clean_runs = memory.ceiling, memory.clean_runs
    if running is not None:  # a running job saying hello again (the daemon restarted): hold what it runs
        session.state = replace(session.state, batch=running)
        session.rejoined = True
    decision = _decide(core, session)
    held = core.session_log.allow()
    if held is not None:
        log.info("session_opened", session=session.sid, job=session.job, pid=session.pid, host=session.host,
                 rank=session.rank, watched=session.local, pool=session.pool, batch_size=decision.plan.batch_size,
                 pod_uid=session.pod_uid, slurm_job_id=session.slurm_job_id, attributed_by=session.attributed_by,
                 held_back=held)
    return {"token": session.token, "plan": decision.plan.to_wire(), "session_ttl": core.config.session_ttl}


def plan(core: Core, req: Dict[str, Any]) -> Result:
    """The plan to follow now.

    Request: token. Reply: plan (batch_size, grad_accum_steps, effective_batch_size, num_workers,
    prefetch_factor, throttle, pressure, reason, source, fresh_for).
    """
    session = core.sessions.get(req.get("token"))
    return {"plan": _decide(core, session).plan.to_wire()}


def report(core: Core, req: Dict[str, Any]) -> Result:
    """What one step cost. Clients send it without waiting; the reply carries the new plan.

    Request: token, batch_size (int >= 1); optional peak_bytes (int >= 0; absent or null: the
    daemon measures the job itself), base_bytes (memory held between steps), batch_bytes (one
    batch's tensors, as a loader delivered it), step (int >= 0), step_seconds (number >= 0),
    loader_workers (int in [0, 1024]: the workers the batch came from; sent by a loader that
    follows the plan's workers, whose batch is then planned beside the workers the plan keeps).
    Reply: plan.
    """
    session = core.sessions.get(req.get("token"))
    batch = _int(req, "batch_size", required=True)
    peak = _int(req, "peak_bytes")
    base = _int(req, "base_bytes")
    batch_bytes = _int(req, "batch_bytes")
    if _int(req, "loader_workers") is not None:
        session.follows_workers = True
    _int(req, "step")
    _number(req, "step_seconds")
    if batch_bytes is not None:
        session.batch_bytes = batch_bytes
    if peak is None:
        peak = _measure_peak(core, session)
    if peak:
        observation = Observation(batch, peak, base, warmup=not session.observations,
                                  settling=session.latest_batch is not None and batch != session.latest_batch)
        if len(session.observations) == 1:  # the first report after the warm-up step
            check_remembered(session, observation)
        session.observe(observation)
        session.latest_peak, session.latest_batch = peak, batch
        session.note_peak(core.clock(), peak)
    session.reports += 1
    session.ooms_unrecovered = 0  # a completed step: memd's answer to its OOMs worked
    if session.at_ceiling and batch == session.state.batch:
        session.ceiling_steps += 1  # a clean step held at its ceiling (SessionRecord.learned)
    session.state = after_report(session.state, batch)
    planned = session.plan
    if planned is not None and _as_planned(core, session, batch, peak):
        return {"plan": planned.to_wire()}
    core.epoch += 1
    return {"plan": _decide(core, session).plan.to_wire()}


def _as_planned(core: Core, session: SessionRecord, batch: int, peak: Optional[int]) -> bool:
    """A step that went as its plan predicted (at the planned batch, its peak within the
    predicted one) decided on the same sample of the machine as the plan: it is learned from at
    the next decision, a sample (``interval``) later at most, not now. A job reports every step
    (10 a second is common) and the daemon samples 5 times a second, so this halves the
    decisions; each costs more with every session in the pool (0.3 ms with 256 in one, where
    the issue's capacity goal is 256 jobs x 10 reports a second in half a core). A step that
    ran over its prediction, or at another batch, is decided on at once."""
    decided = session.decided
    return (decided is not None and decided[0][0] is core.snapshot and session.plan is not None
            and batch == session.plan.batch_size and peak is not None and session.predicted_peak_bytes is not None
            and peak <= session.predicted_peak_bytes)


def oom(core: Core, req: Dict[str, Any]) -> Result:
    """A step ran out of memory at batch_size. The client waits for this reply.

    Request: token, batch_size (int >= 1). Reply: plan (at most 75 % of batch_size).
    """
    session = core.sessions.get(req.get("token"))
    batch = _int(req, "batch_size", required=True)
    session.ooms += 1
    session.ooms_unrecovered += 1
    session.note_oom(core.clock())
    core.ooms_reported += 1
    session.state = after_oom(session.state, batch, session.limits, core.config.policy)
    core.epoch += 1
    planned = _decide(core, session).plan
    held = core.oom_log.allow()
    if held is not None:
        log.warning("oom_reported", session=session.sid, job=session.job, pid=session.pid, batch_size=batch,
                    new_batch_size=planned.batch_size, ooms=session.ooms, pool=session.pool,
                    pod_uid=session.pod_uid, slurm_job_id=session.slurm_job_id, held_back=held)
    return {"plan": planned.to_wire()}


def bye(core: Core, req: Dict[str, Any]) -> Result:
    """End a session; what it learned is kept for the job's next run.

    Request: token (str). Reply: {} (an unknown token is not an error: bye is idempotent).
    """
    token = _str(req, "token", required=True)
    session = core.sessions.close(token)
    if session is not None:
        end(core, session, "bye")
    return {}


def status(core: Core, req: Dict[str, Any]) -> Result:
    """The daemon's view of the machine and its sessions (no tokens).

    Request: nothing. Reply: version, host, uptime_seconds, pressure_level, snapshot (the
    `memd sample --json` fields), sessions: [{job, pid, host, rank, pool, reports, ooms,
    latest_batch, latest_peak_bytes, budget_bytes, predicted_peak_bytes, ceiling, plan, pool_key (what
    its curve is remembered under; null while its GPU cannot be told), unwatched (why a job on
    this host is not measured here, or null), pod_uid, slurm_job_id (the Kubernetes pod and
    Slurm job it runs in, or null), attributed_by ("cgroup" or "environ": read by the daemon
    from the job's process; "client": as its hello said; null)}].
    """
    snapshot = core.snapshot
    return {
        "version": VERSION,
        "host": core.host,
        "uptime_seconds": round(core.uptime(), 3),
        "pressure_level": core.pressure.level,
        "snapshot": as_json(snapshot) if snapshot is not None else None,
        "sessions": [_session_view(s) for s in core.sessions],
    }


def ping(core: Core, req: Dict[str, Any]) -> Result:
    """Liveness. Request: nothing. Reply: pong (true), version, uptime_seconds."""
    return {"pong": True, "version": VERSION, "uptime_seconds": round(core.uptime(), 3)}


def curves(core: Core, req: Dict[str, Any]) -> Result:
    """What the daemon remembers for the jobs' next runs (`memd curves`), one page at a time.

    Request: optional after ([job, pool], the previous page's next). Reply: curves ([{job, pool,
    points: [[batch, peak_bytes], ...] (oldest first), ceiling (int or null), updated (unix
    seconds)}], by job then pool), total (entries remembered), next ([job, pool] to ask for the
    next page with, or null on the last). A reply stays within MAX_MESSAGE_BYTES (memd.curves).
    """
    after = req.get("after")
    if after is not None and not (isinstance(after, list) and len(after) == 2 and all(
            isinstance(v, str) and len(v) <= MAX_KEY_CHARS for v in after)):
        raise Invalid("after must be [job, pool], two strings of at most %d characters (a reply's next)"
                      % MAX_KEY_CHARS)
    return learned.page(core.store.keys(), core.store.recall, after)


def forget(core: Core, req: Dict[str, Any]) -> Result:
    """Forget what was learned for a job, in every pool or one (`memd forget`); written to the
    state file at once. Whoever may connect may call it: they could as well teach the job's
    curve anything with hello and report (docs/protocol.md, "Who may forget").

    Request: job (str of 1 to 128 characters), optional pool (a pool key as `curves` shows it).
    Reply: forgotten (curves dropped), sessions (live sessions of the job, in that pool, whose
    learning until now will not be remembered; their plans are unchanged), saved (false: the
    state file could not be written, the daemon logged why and retries at its next flush).
    """
    job = _str(req, "job", required=True, limit=128)
    pool = _str(req, "pool", limit=MAX_KEY_CHARS)
    if not job:
        raise Invalid("job must not be empty")
    if pool == "":
        raise Invalid("pool must not be empty (leave it out to forget every pool)")
    dropped = core.store.forget(job, pool)
    sessions = [s for s in core.sessions if s.job == job and (pool is None or s.pool_key == pool)]
    for session in sessions:
        session.forget_learned()
    return {"forgotten": len(dropped), "sessions": len(sessions), "saved": core.store.flush()}


HANDLERS: Dict[str, Callable[[Core, Dict[str, Any]], Result]] = {
    "hello": hello, "plan": plan, "report": report, "oom": oom, "bye": bye, "status": status, "ping": ping,
    "curves": curves, "forget": forget,
}
assert set(HANDLERS) == set(protocol.OPS)


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
    next run: batch 1 instead of 528), and 512 junk names evicted every curve."""
    if not session.local:
        return  # what it reported cannot be told from a forgery: planned by, never kept
    observations, ceiling, clean_runs = session.learned(core.config.policy.stable_steps)
    if session.pool_key is None or (not observations and ceiling is None and session.inherited_ceiling is None):
        return
    core.store.remember(session.job, session.pool_key, observations, ceiling, clean_runs)


def _recall(core: Core, session: SessionRecord) -> Optional[Memory]:
    """What earlier runs of the session's job left under its key; else, for a job memd now
    knows the owner of, what an earlier memd kept before keys had owners (read, never written:
    its next save is its owner's)."""
    if session.pool_key is None:
        return None
    memory = core.store.recall(session.job, session.pool_key)
    if memory is None and session.owner is not None:
        memory = core.store.recall(session.job, session.pool_key.rpartition(OWNER)[0])
    return memory


def _decide(core: Core, session: SessionRecord):
    """plan_session, memoised until one of its inputs changes.

    A decision is a pure function of the published snapshot, pressure, job trees, config and
    the sessions (every change to one, a new plan included, bumps ``core.epoch``), and deciding
    again on its own output state is a fixed point; so a repeated ``plan`` costs a few identity
    checks, not a policy run.
    """
    key = (_snapshot(core), core.pressure, core.jobs, core.config, core.epoch)
    cached = session.decided
    if cached is not None and all(a is b for a, b in zip(cached[0], key)):
        return cached[1]
    previous = session.plan
    decision = plan_session(session, key[0], key[1].level, core.sessions, key[2], key[3].policy)
    if decision.plan != previous:
        core.epoch += 1  # the pool's other sessions reserve this one's growth: they decide again
    session.decided = (key[:4] + (core.epoch,), decision)
    return decision


def _snapshot(core: Core):
    if core.snapshot is None:
        raise NotReady("the daemon has not sampled the machine yet")
    return core.snapshot


def _local(core: Core, host: str, pid: int, pid_ns: Optional[int], start_time: Optional[int],
           peer: Optional[Peer] = None) -> Tuple[bool, Optional[str]]:
    """Whether the pid a hello names is the client's own process here, which the daemon may
    measure, reset the peak of and watch; and if not, though the job is on this host, why (for
    its plan). A job in another pid namespace (a container sharing the hostname) names a pid
    that here is an unrelated process: pid_ns and start_time, when the client sends them, tell.
    A pid_ns the daemon cannot check against its own is not trusted: measuring a stranger is
    the harm this prevents, and a client that read its namespace runs on a kernel that shows
    the daemon its own, unless the daemon's /proc hides it (or the client's host is another
    machine of the same name). Where the kernel says who asks (``peer``), a process of another
    user is not watched unless root asks: its curves would be written by whoever named it."""
    if host != core.host:
        return False, None  # another machine: planned from its reports, as ever
    here = os.path.exists(os.path.join(core.proc_root, str(pid)))
    if pid_ns is not None:
        own = procs.pid_namespace("self", core.proc_root)
        if own is None:
            return False, "pid %d cannot be checked (the daemon cannot read its own pid namespace)" % pid
        if own != pid_ns:
            return False, ("pid %d here is another process (this job is in another pid namespace)" % pid if here
                           else "this job is in another pid namespace")
    if not here:
        return False, None
    if start_time is not None and procs.process_start_time(pid, core.proc_root) != start_time:
        return False, "pid %d here is another process (it started at another time than this job)" % pid
    if peer is not None and peer.uid != 0 and peer.uid != procs.process_owner(pid, core.proc_root):
        return False, "pid %d here is another user's process" % pid
    return True, None


def _job_cgroup(core: Core, pid: int) -> Optional[Cgroup]:
    """The job's own memory cgroup, read as it says hello (through /proc/PID/cgroup, as the
    sampler reads it): the pool its curves are kept under and its first plan's bound, known
    before its first sample. None when there is none or it cannot be read (counted)."""
    try:
        return cgroups.read_cgroup(pid, core.proc_root)
    except (OSError, ValueError, KeyError, IndexError):
        core.sample_errors["cgroup"] += 1
        return None


def _measure_peak(core: Core, session: SessionRecord) -> Optional[int]:
    """The job's peak since its last report, measured here: on a GPU pool what NVML attributes
    to the job's processes on that GPU (it includes what PyTorch's allocator keeps reserved);
    on the host pool the trainer's peak RSS. None when unknown: a guess from another pool, or
    a partial sum, would teach the curve a wrong point."""
    if not session.local or session.pool is None:  # not this host's process, or its GPU is unknown
        return None
    if session.pool != HOST:
        job, snapshot = core.jobs.get(session.pid), core.snapshot
        gpu = next((g for g in snapshot.gpus if g.uuid == session.pool), None) if snapshot else None
        if job is None or gpu is None:
            return None
        pids = set(job_pids(job))
        used = [p.used_bytes for p in gpu.processes if p.pid in pids]
        known = [u for u in used if u is not None]
        return sum(known) if known and len(known) == len(used) else None
    peak = procs.read_peak_rss(session.pid, core.proc_root)
    procs.reset_peak_rss(session.pid, core.proc_root)
    return peak


def _session_view(s: SessionRecord) -> Result:
    return {
        "job": s.job, "pid": s.pid, "host": s.host, "rank": s.rank, "pool": s.pool, "pool_key": s.pool_key,
        "reports": s.reports, "ooms": s.ooms, "latest_batch": s.latest_batch,
        "latest_peak_bytes": s.latest_peak, "budget_bytes": s.budget_bytes,
        # A plan held far past its curve (its GPU not known) predicted 2**71: more than msgpack carries
        "predicted_peak_bytes": (min(int(s.predicted_peak_bytes), 2 ** 63 - 1)
                                 if s.predicted_peak_bytes is not None else None),
        "ceiling": s.state.ceiling, "plan": s.plan.to_wire() if s.plan is not None else None,
        "unwatched": s.unwatched, "pod_uid": s.pod_uid, "slurm_job_id": s.slurm_job_id,
        "attributed_by": s.attributed_by,
    }


@overload
def _int(req: Dict[str, Any], name: str, required: Literal[True]) -> int: ...
@overload
def _int(req: Dict[str, Any], name: str, *, default: int) -> int: ...
@overload
def _int(req: Dict[str, Any], name: str) -> Optional[int]: ...


def _int(req: Dict[str, Any], name: str, required: bool = False, default: Optional[int] = None) -> Optional[int]:
    """An integer field within its protocol.FIELD_RANGES range (every field has one: no number a
    client sends may drive a loop or an allocation unbounded)."""
    value = req.get(name)
    if value is None:
        if required:
            raise Invalid("%s is required" % name)
        return default
    if not whole(value):
        raise Invalid("%s must be an integer, not %s" % (name, type(value).__name__))
    low, high = protocol.FIELD_RANGES[name]
    if not low <= value <= high:
        raise Invalid("%s must be an integer in [%d, %d], got %d" % (name, low, high, value))
    return value


def _number(req: Dict[str, Any], name: str) -> Optional[float]:
    """A number field within its protocol.FIELD_RANGES range; NaN and infinities are refused."""
    value = req.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise Invalid("%s must be a number, not %s" % (name, type(value).__name__))
    low, high = protocol.FIELD_RANGES[name]
    if not low <= value <= high:
        raise Invalid("%s must be a finite number in [%g, %g], got %r" % (name, low, high, value))
    return float(value)


@overload
def _str(req: Dict[str, Any], name: str, required: Literal[True], limit: int = 256) -> str: ...
@overload
def _str(req: Dict[str, Any], name: str, *, limit: int = 256) -> Optional[str]: ...


def _str(req: Dict[str, Any], name: str, required: bool = False, limit: int = 256) -> Optional[str]:
    value = req.get(name)
    if value is None:
        if required:
            raise Invalid("%s is required" % name)
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise Invalid("%s must be a string of at most %d characters" % (name, limit))
    return value


def _matching(req: Dict[str, Any], name: str, pattern) -> Optional[str]:
    """A string field that must match ``pattern`` (an identifier: nothing else gets into a label)."""
    value = _str(req, name, limit=64)
    if value is not None and not pattern.match(value):
        raise Invalid("%s %r is not a valid %s" % (name, value[:64], name.replace("_", " ")))
    return value


def _bounded_hints(hints: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """The hints within protocol.HINT_RANGES, and why each other one was dropped: estimators
    cost in proportion to a model's size, so a hint beyond any real model is ignored, not used
    (the job is planned as if it had not given it; an error would leave it with no plan)."""
    kept, ignored = {}, []
    for name, value in hints.items():
        problem = protocol.hint_problem(name, value)
        if problem is None:
            kept[name] = value
        else:
            ignored.append(problem)
    return kept, ignored


"""The ops of one job's session: hello, plan, report, oom, bye.

Each reads top to bottom: check the request (fields), measure what the daemon may of the job's
own process (watch), let the policy decide (memo.decide), and record it on the session.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, NamedTuple, Optional

import structlog

from memd import attribution
from memd.client import protocol
from memd.client.counts import at_least
from memd.core import Core
from memd.ops import fields, lifecycle, memo, watch
from memd.ops.fields import Invalid
from memd.planner import check_remembered, identify, prior_from_hints, settling
from memd.policy.controller import FIRST_BATCH, ControlState, Limits, after_oom, after_report
from memd.policy.fit import Observation
from memd.sampling import procs
from memd.sessions import Peer, SessionRecord, TooManySessions

Result = Dict[str, Any]

log = structlog.get_logger("memd.ops")


class Hello(NamedTuple):
    """A hello's fields, every one checked before anything changes."""
    job: str
    pid: int
    host: str
    limits: Limits
    hints: Dict[str, Any]
    ignored: List[str]  # why each dropped hint was dropped
    rank: Optional[int]
    world_size: Optional[int]
    local_world_size: Optional[int]
    nonce: Optional[str]
    running: Optional[int]  # batch_size: the batch a job runs already (the daemon restarted)
    told: attribution.Attribution  # the pod and Slurm job the client says it runs in
    pid_ns: Optional[int]
    start_time: Optional[int]
    device: Optional[str]
    device_uuid: Optional[str]
    visible_devices: Optional[str]
    cpus: Optional[float]


def hello(core: Core, req: Dict[str, Any], peer: Optional[Peer] = None, key: Optional[str] = None) -> Result:
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
    (watch.watchable); a job on this host that fails them is planned from its reports, and says why.
    batch_size (int: the batch the job runs now, sent by a client saying hello again because
    the daemon restarted): its plan holds that batch until the daemon has read the job's
    memory, rather than budget a running job as if its memory were someone else's.
    pod_uid (str: the UID of the Kubernetes pod it runs in) and slurm_job_id (str of digits):
    where the daemon can read the job's process it attributes the session itself (cgroup path,
    then environment: memd.attribution) and these are ignored; else they are shown as told.
    Reply: token (str, needed by every later op of this session), plan, session_ttl (seconds).
    Every number within its protocol.FIELD_RANGES range.

    ``peer``: who asked, in the kernel's word (the ipc socket's credentials; None over TCP). A
    job in a container is its process as the daemon sees it (watch.as_seen_here); a pid that
    belongs to another user than the one asking is not watched (watch.watchable), and
    when every slot is taken a user holding fewer sessions takes the newest of the user holding
    the most (Sessions.crowding). ``key``: the client's CURVE public key, as the allow-list
    admitted it (None without CURVE): its curves are kept and read under that key, and it is one
    user in the sharing of slots.
    """
    asked = read_hello(req)
    lifecycle.expire(core)  # a job the OOM killer just ended is learned before its restart says hello
    pid, host, pid_ns = watch.as_seen_here(core, asked.pid, asked.host, asked.pid_ns, asked.start_time, peer)
    asked = asked._replace(pid=pid, host=host, pid_ns=pid_ns)  # a job in a container, as seen from here
    local, unwatched = watch.watchable(core, asked.host, asked.pid, asked.pid_ns, asked.start_time, peer)
    snapshot = memo.snapshot(core)
    earlier = core.sessions.find(asked.host, asked.pid, asked.nonce) if asked.nonce is not None else None
    if earlier is not None:  # the same client Session again: its earlier hello's reply was lost
        if earlier.job != asked.job:
            raise Invalid("this nonce belongs to a session of another job")
        return {"token": earlier.token, "plan": memo.decide(core, earlier).plan.to_wire(),
                "session_ttl": core.config.session_ttl}
    session = _open(core, asked, local, unwatched, peer, key)
    held = core.log_throttle.allow("hints") if asked.ignored else None  # a peer may repeat it: a line a minute
    if held is not None:
        log.warning("hints_ignored", job=session.job, session=session.sid, reasons=asked.ignored,
                    held_back=held)
    core.epoch += 1
    session.owner = procs.process_owner(asked.pid, core.proc_root) if local else None
    session.pool_key = identify(session, snapshot, core.config.policy)
    memory = lifecycle.recall(core, session)
    if memory is not None:
        session.remembered = list(memory.observations)
        if memory.ceiling is not None:  # an earlier run ran out of memory above it: start below
            ceiling = max(asked.limits.min_batch, memory.ceiling)
            session.state = ControlState(ceiling=ceiling, stable=core.config.policy.stable_steps)
            session.inherited_ceiling, session.clean_runs = memory.ceiling, memory.clean_runs
            session.ceiling_cause = memory.cause
            if memory.cause == "kill":
                # Killed: start where an earlier run's step ran, below the kill and at most half way
                # to it (a rarer step than any it reported may have killed it), else at min_batch.
                ran = max([o.batch for o in memory.observations if o.batch <= ceiling], default=asked.limits.min_batch)
                start = max(asked.limits.min_batch, min(ran, (ceiling + 1) // 2))
                session.state = replace(session.state, killed=ceiling + 1, batch=start)
    if asked.running is not None:  # a running job saying hello again (the daemon restarted): hold what it runs
        session.state = replace(session.state, batch=asked.running)
        session.rejoined = True
    elif local:
        session.held_before_steps = watch.held_now(core, asked.pid)
    decision = memo.decide(core, session)
    held = core.session_log.allow()
    if held is not None:
        log.info("session_opened", session=session.sid, job=session.job, pid=session.pid, host=session.host,
                 rank=session.rank, watched=session.local, pool=session.pool, batch_size=decision.plan.batch_size,
                 pod_uid=session.pod_uid, slurm_job_id=session.slurm_job_id, attributed_by=session.attributed_by,
                 held_back=held)
    return {"token": session.token, "plan": decision.plan.to_wire(), "session_ttl": core.config.session_ttl}


def read_hello(req: Dict[str, Any]) -> Hello:
    """A hello's fields, checked (Invalid names the first bad one)."""
    min_batch = fields.integer(req, "min_batch", default=1)
    max_batch, default_batch = fields.integer(req, "max_batch"), fields.integer(req, "default_batch")
    target = fields.integer(req, "target_effective_batch")
    if max_batch is not None and max_batch < min_batch:
        raise Invalid("max_batch %d is below min_batch %d" % (max_batch, min_batch))
    if target is not None and target < min_batch:
        raise Invalid("target_effective_batch %d is below min_batch %d" % (target, min_batch))
    hints, ignored = fields.hints(req)
    limits = Limits(min_batch, max_batch, default_batch, target, num_workers=at_least(hints.get("num_workers"), 0),
                    prefetch_factor=at_least(hints.get("prefetch_factor"), 1))
    pid = fields.integer(req, "pid", required=True)
    rank, world_size = fields.integer(req, "rank"), fields.integer(req, "world_size")
    if rank is not None and world_size is not None and rank >= world_size:
        raise Invalid("rank %d is not below world_size %d" % (rank, world_size))
    fields.integer(req, "local_rank")
    host = fields.text(req, "host", required=True, limit=255)
    job = fields.text(req, "job", required=True, limit=128)
    nonce = fields.text(req, "nonce", limit=64)
    if nonce is not None and len(nonce) < 16:
        raise Invalid("nonce must be a string of 16 to 64 characters")
    running = fields.integer(req, "batch_size")
    told = attribution.told(fields.matching(req, "pod_uid", protocol.POD_UID),
                            fields.matching(req, "slurm_job_id", protocol.SLURM_JOB_ID))
    return Hello(
        job=job, pid=pid, host=host, limits=limits, hints=hints, ignored=ignored, rank=rank, world_size=world_size,
        local_world_size=fields.integer(req, "local_world_size"), nonce=nonce, running=running, told=told,
        pid_ns=fields.integer(req, "pid_ns"), start_time=fields.integer(req, "start_time"),
        device=fields.text(req, "device", limit=64), device_uuid=fields.text(req, "device_uuid", limit=96),
        visible_devices=fields.text(req, "cuda_visible_devices", limit=256), cpus=fields.number(req, "cpus") or None,
    )


def _open(core: Core, asked: Hello, local: bool, unwatched: Optional[str], peer: Optional[Peer],
          key: Optional[str] = None) -> SessionRecord:
    """A new session for a hello. When every slot (or the unwatched share) is taken, the dead
    make room, and are remembered and counted as ever; if still full, one user's flood gives
    way to another user's job (Sessions.crowding)."""
    found = attribution.read(asked.pid, core.proc_root) if local else None
    found = asked.told if found is None else found  # what the daemon can read wins over what it is told
    record = dict(
        pod_uid=found.pod_uid, slurm_job_id=found.slurm_job_id, attributed_by=found.source,
        job=asked.job, nonce=asked.nonce, pid=asked.pid, host=asked.host, local=local,
        cgroup=watch.job_cgroup(core, asked.pid) if local else None,
        start_time=procs.process_start_time(asked.pid, core.proc_root) if local else None, limits=asked.limits,
        rank=asked.rank, world_size=asked.world_size, device=asked.device, device_uuid=asked.device_uuid,
        visible_devices=asked.visible_devices, hints=dict(asked.hints), prior=prior_from_hints(asked.hints),
        cpus=asked.cpus, local_world_size=asked.local_world_size, unwatched=unwatched,
        peer_uid=None if peer is None else peer.uid, peer_pid=None if peer is None else peer.pid, key=key,
    )
    try:
        return core.sessions.open(**record)
    except TooManySessions:
        lifecycle.expire(core)
        crowded = core.sessions.crowding(peer, key, local)
        if crowded is not None:
            core.sessions.close(crowded.token)
            lifecycle.end(core, crowded, "evicted")
        return core.sessions.open(**record)


def plan(core: Core, req: Dict[str, Any]) -> Result:
    """The plan to follow now.

    Request: token. Reply: plan (batch_size, grad_accum_steps, effective_batch_size, num_workers,
    prefetch_factor, throttle, pressure, reason, source, fresh_for).
    """
    session = core.sessions.get(req.get("token"))
    return {"plan": memo.decide(core, session).plan.to_wire()}


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
    batch = fields.integer(req, "batch_size", required=True)
    peak = fields.integer(req, "peak_bytes")
    base = fields.integer(req, "base_bytes")
    batch_bytes = fields.integer(req, "batch_bytes")
    if fields.integer(req, "loader_workers") is not None:
        session.follows_workers = True
    fields.integer(req, "step")
    fields.number(req, "step_seconds")
    if batch_bytes is not None:
        session.batch_bytes = batch_bytes
    session.reports_peaks = peak is not None
    if peak is None:
        peak = watch.measure_peak(core, session)
        if peak is not None and base is None and session.pool == "host" and batch < FIRST_BATCH:
            # Below memd's first batch a step is mostly the framework, and its peak alone bounds a
            # sample at all of it: what the trainer held before its first step tells them apart.
            # Not above: what it held then may be more than its steps keep (a 27-sample step's
            # fixed part was 62 MiB less), and there the peak's own bound is sure.
            base = session.held_before_steps  # in the units the daemon measures the peak in
    waiting = settling(session)  # the plan waits for a second step at its batch
    if peak:
        observation = Observation(batch, peak, base, warmup=not session.observations,
                                  settling=session.latest_batch is not None and batch != session.latest_batch)
        if len(session.observations) == 1:  # the first report after the warm-up step
            check_remembered(session, observation)
        session.observe(observation)
        session.latest_peak, session.latest_batch = peak, batch
        session.note_peak(core.clock(), peak)
    session.reports += 1
    session.reported_at.append(core.clock())
    session.ooms_unrecovered = 0  # a completed step: memd's answer to its OOMs worked
    if session.at_ceiling and batch == session.state.batch:
        session.ceiling_steps += 1  # a clean step held at its ceiling (SessionRecord.learned)
    session.state = after_report(session.state, batch)
    planned = session.plan
    if planned is not None and as_planned(core, session, batch, peak, waiting):
        return {"plan": planned.to_wire()}
    core.epoch += 1
    return {"plan": memo.decide(core, session).plan.to_wire()}


def as_planned(core: Core, session: SessionRecord, batch: int, peak: Optional[int], waiting: bool) -> bool:
    """A step that went as its plan predicted (at the planned batch, its peak within the
    predicted one) decided on the same sample of the machine as the plan: it is learned from at
    the next decision, a sample (``interval``) later at most, not now. A job reports every step
    (10 a second is common) and the daemon samples 5 times a second, so this halves the
    decisions; each costs more with every session in the pool (0.3 ms with 256 in one, where
    the issue's capacity goal is 256 jobs x 10 reports a second in half a core). A step that
    ran over its prediction, or at another batch, is decided on at once.

    So is the step a plan was holding for (``waiting``: the plan waited for a second step at its
    batch, planner.settling; or the last clean step an out-of-memory cut holds for): it changes
    the plan, not just the curve. Deferred, the reply to that step and every plan until the
    next sample said "keeping 189 until a second step there" while status counted both steps,
    and the budget the plan was decided on allowed 266."""
    decided = session.decided
    state = session.state
    ends_hold = (waiting and not settling(session)) or (
        state.ceiling is not None and state.stable == core.config.policy.stable_steps)
    return (not ends_hold and decided is not None and decided[0][0] is core.snapshot and session.plan is not None
            and batch == session.plan.batch_size and peak is not None and session.predicted_peak_bytes is not None
            and peak <= session.predicted_peak_bytes)


def oom(core: Core, req: Dict[str, Any]) -> Result:
    """A step ran out of memory at batch_size. The client waits for this reply.

    Request: token, batch_size (int >= 1). Reply: plan (at most 75 % of batch_size).
    """
    session = core.sessions.get(req.get("token"))
    batch = fields.integer(req, "batch_size", required=True)
    session.ooms += 1
    session.ooms_unrecovered += 1
    session.note_oom(core.clock())
    session.ceiling_cause = session.ceiling_cause or "oom"
    core.ooms_reported += 1
    session.state = after_oom(session.state, batch, session.limits, core.config.policy)
    core.epoch += 1
    planned = memo.decide(core, session).plan
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
    token = fields.text(req, "token", required=True)
    session = core.sessions.close(token)
    if session is not None:
        killed = lifecycle.killed_batch(core, session, bye=True)  # its worker was killed, and the loop gave up
        if killed is not None:
            lifecycle.learn_kill(core, session, killed)
        lifecycle.end(core, session, "bye")
    return {}

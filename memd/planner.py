"""Assemble one session's inputs for the controller and record its decision.

Everything here is a function of values the daemon already holds (the latest Snapshot, the
jobs' process trees, the sessions): no sampling, no sockets. It is the seam between the
registry of sessions and the pure policy.
"""
from __future__ import annotations

import collections
import hashlib
import json
import math
import statistics
from dataclasses import replace
from typing import Dict, Iterable, List, Optional, Tuple

from memd.claims import Claims, Others, Use, counts, gather, neighbour
from memd.config import PolicyConfig
from memd.policy import budget, estimate
from memd.policy.controller import Decision, WorkerFacts, decide
from memd.policy.fit import NOISE, Observation, Prior, fit
from memd.policy.frozen import evolve
from memd.policy.growth import COURSE_ERROR, RATE_SPAN, growth, keep
from memd.policy.pressure import group_signals, next_state, rank, thrashing
from memd.sampling.snapshot import DISCRETE, Gpu, JobMemory, Snapshot, gpu_bytes
from memd.sessions import KEY_OWNER, OWNER, SessionRecord
from memd.units import GiB

AGREE = 0.10  # a remembered curve is trusted when it predicts the first report within 10 %
MAX_WORKERS, WORKER_READS = 64, 8  # workers followed per session, and reads of each kept
# Reads of a worker are kept this far apart (the latest replaces a closer one), so the reads kept
# span a rate's RATE_SPAN: a job reporting five steps a second is read as often.
READ_GAP = RATE_SPAN / (WORKER_READS - 1)
# Seconds of the workers' growth held back from the batch: two job reads (2 s apart), the plan
# reaching the loop, and a step or two there at the new batch.
GROWTH_AHEAD = 10.0


def pool_for(session: SessionRecord, snapshot: Snapshot, job: Optional[JobMemory], cfg: PolicyConfig) -> budget.Pool:
    if snapshot.memory_model == DISCRETE:
        pids = budget.job_pids(job) if job is not None else [session.pid]
        gpu = budget.find_gpu(snapshot.gpus, session.device_uuid, session.device, session.visible_devices, pids)
        pool = budget.gpu_pool(gpu, job, cfg) if gpu is not None else None
        if pool is not None:
            return pool
    return budget.host_pool(snapshot, job, cfg, session.cgroup, mapped_kept(session, job), session.reports_peaks)


def mapped_kept(session: SessionRecord, job: Optional[JobMemory]) -> Optional[int]:
    """The most file pages the job's group has kept mapped this run (budget.group_margin), None
    until read. The most, not the latest: near its limit the kernel takes them back (the workers
    job's from 96 MiB to 32 at the batch that fits), and a margin that shrank with them would
    let the job grow into the pages its code still needs."""
    mapped = job.cgroup.mapped_file_bytes if job is not None and job.cgroup is not None else None
    if mapped is not None:
        session.planner.mapped_file = max(session.planner.mapped_file or 0, mapped)
    return session.planner.mapped_file


def pool_key(pool: budget.Pool, snapshot: Snapshot) -> str:
    """What must match for a remembered curve to apply: the same kind and size of pool."""
    for gpu in snapshot.gpus:
        if gpu.uuid == pool.name:
            return gpu_key(gpu)
    return "%s:%d" % (pool.kind, pool.capacity_bytes // GiB)


def gpu_key(gpu: Gpu) -> str:
    return "gpu:%s:%d" % (gpu.name, gpu.total_bytes or 0)


def identify(session: SessionRecord, snapshot: Snapshot, cfg: PolicyConfig) -> Optional[str]:
    """The key a job's curves are looked up and saved under: its pool, from what is known when
    it says hello, then its configuration and owner (comparable()). The pool: its own cgroup (read
    then, ``session.cgroup``) on the host, the GPU it names on a discrete machine (else the
    only one, or the one its process already uses; else any, when the host's GPUs are all
    alike). None when that GPU cannot be told yet: plan_session keys the session by the GPU it
    is first seen on. Looked up at hello before the job's cgroup was known and saved with it
    later, an 8 GB cgroup on a 64 GB host read cpu:59 and wrote cpu:7, and every run started
    from nothing."""
    if snapshot.memory_model == DISCRETE:
        gpu = budget.find_gpu(snapshot.gpus, session.device_uuid, session.device, session.visible_devices,
                              [session.pid])
        if gpu is not None and gpu.name:
            return gpu_key(gpu) + comparable(session)
        alike = {gpu_key(g) for g in snapshot.gpus if g.name and g.total_bytes}
        if len(alike) == 1:
            return alike.pop() + comparable(session)
        if not on_cpu(session):
            return None
    return pool_key(budget.host_pool(snapshot, None, cfg, session.cgroup), snapshot) + comparable(session)


def comparable(session: SessionRecord) -> str:
    """What follows the pool in a job's key: its configuration, then its owner."""
    return configuration(session) + ownership(session)


def ownership(session: SessionRecord) -> str:
    """"@key:" and the CURVE key its client was admitted with (the daemon's own check, whether
    or not it can watch the process), else "@uid:N", the user its process runs as ("" when
    neither is known: a session memd cannot watch, whose learning is never kept). Curves are
    their owner's: another user's (or key's) job of the same name neither reads nor overwrites
    them, and an owner who fills the store evicts their own first (state.StateStore.remember)."""
    if session.key is not None:
        return KEY_OWNER + session.key
    return "" if session.owner is None else "%s%d" % (OWNER, session.owner)


# Hints that change how the job's data reaches it, not what one of its steps costs.
NOT_CONFIGURATION = ("num_workers", "prefetch_factor")


def configuration(session: SessionRecord) -> str:
    """What else must match for a remembered curve to apply, as a pool key's suffix: the job's
    model hints and its max and target batch. Runs of one job name with another model size, or
    another max_batch, are learned apart: an OOM ceiling or a curve from one is not the other's
    ("" with none of them, the key of a job that says nothing but its name)."""
    hints = {k: v for k, v in session.hints.items() if k not in NOT_CONFIGURATION}
    limits = {"max_batch": session.limits.max_batch, "target": session.limits.target}
    comparable = {k: v for k, v in dict(limits, hints=hints or None).items() if v is not None}
    if not comparable:
        return ""
    text = json.dumps(comparable, sort_keys=True, separators=(",", ":"))
    return "#" + hashlib.sha256(text.encode()).hexdigest()[:8]


def on_cpu(session: SessionRecord) -> bool:
    """The job says it trains on the CPU (``device`` "cpu"), on a machine that has GPUs."""
    return (session.device or "").split(":")[0].strip().lower() == "cpu"


def use_now(session: SessionRecord, pool_name: Optional[str], snapshot: Snapshot,
            jobs: Dict[int, JobMemory]) -> Optional[int]:
    """What a session's job holds in the pool now, in the pool's units: on the host its trainer's
    resident set less its file pages and its workers' own memory (with the batches on their way
    from them); on a GPU what its processes use there. None when it is not read."""
    job = jobs.get(session.pid) if session.local else None
    if job is None or not job.alive:
        return None
    if pool_name == budget.HOST:
        held = job.trainer_held_bytes
        if held is None:
            return None
        if len(job.processes) == 1:  # and the step's shared memory it just unmapped (steadied)
            return held + job.unmapped_shmem_bytes
        return held + sum(b for b in job.worker_bytes if b > 0) + (job.in_flight_shmem_bytes or 0)
    gpu = next((g for g in snapshot.gpus if g.uuid == pool_name), None)
    return gpu_bytes(gpu.processes, set(budget.job_pids(job))) if gpu is not None else None


def outside(pool: budget.Pool, others: Others) -> Optional[int]:
    """What the pool holds that no session of it does (other processes, the kernel, the job's own
    workers on the host): its use less the job's and the other sessions'. None while the job's
    own is not read."""
    if pool.own_bytes is None:
        return None
    return max(0, pool.in_use_bytes - pool.own_bytes - others.held)


def growth_ahead(session: SessionRecord, job: Optional[JobMemory], pool: budget.Pool, others: Others,
                 cfg: PolicyConfig) -> int:
    """What the memory outside the pool's sessions may add before the job's next plan takes effect:
    the most it rose within one of the job's steps and two reads, over the last
    others_horizon_seconds (budget.rise_within). A plan changes only at a step's start: a job
    whose neighbour grows while it runs a step must have that growth to spare. A job read whole
    only (one with workers, Sampler.paired) leaves this to its workers' course: its own workers
    are outside its trainer, and their growth is held back as theirs (worker_facts)."""
    if job is None or len(job.processes) != 1 or pool.own_bytes is None:
        return 0
    beside = outside(pool, others)
    if beside is None:
        return 0
    reads = session.planner.outside
    if not reads or reads[-1][0] != job.read_at:
        reads.append((job.read_at, beside))
    while reads and reads[0][0] < job.read_at - cfg.others_horizon_seconds:
        reads.popleft()
    gap = reads[-1][0] - reads[-2][0] if len(reads) > 1 else 0.0
    return budget.rise_within(list(reads), (session.step_seconds or 0.0) + 2 * gap)


def neighbours(session: SessionRecord, pool_name: Optional[str], sessions: Iterable[SessionRecord],
               at: float, use: Optional[Use] = None) -> Others:
    """The other sessions in a pool whose claims count against this one's room, as of the
    snapshot taken ``at`` (claims.counts: those whose process the daemon watches). The registry
    keeps them per pool and snapshot (Sessions.claims, kept up to date by record_claim), so a
    decision reads sums, not every session; a plain list of sessions is read whole."""
    memo: Optional[Dict[Optional[str], Claims]] = getattr(sessions, "claims", None)
    if memo is None:
        return gather(sessions, pool_name, at, use=use).others(session.sid)
    version = getattr(sessions, "version", 0)
    kept = memo.get(pool_name)
    if kept is None or kept.at != at or kept.version != version:
        for name in [name for name, c in memo.items() if c.at != at or c.version != version]:
            del memo[name]  # another snapshot's or membership's: gathered again when asked for
        kept = memo[pool_name] = gather(sessions, pool_name, at, version, use)
    return kept.others(session.sid)


def record_claim(session: SessionRecord, sessions: Iterable[SessionRecord], was: Optional[str], at: float,
                 use: Optional[Use] = None) -> None:
    """A session decided: its part of its pool's claims (neighbours) is its new plan's."""
    memo: Optional[Dict[Optional[str], Claims]] = getattr(sessions, "claims", None)
    if memo is None:
        return
    if was != session.pool and was in memo:
        memo[was].drop(session.sid)
    kept = memo.get(session.pool)
    if kept is not None and kept.at == at and counts(session, session.pool):
        kept.put(session.sid, neighbour(session, at, use))


def group_level(session: SessionRecord, job: Optional[JobMemory], cfg: PolicyConfig) -> str:
    """The pressure in the job's own memory pool, its cgroup with a limit: the host's signals are
    the whole machine's (its free memory says nothing of a full 2 GiB group, and its PSI counts
    the group's stalls among every other task's). The group's PSI where it has one (v2), else
    whether it thrashes (policy.pressure.thrashing), with the host's hysteresis."""
    memo = session.planner
    cg = job.cgroup if job is not None else None
    if job is None or cg is None or cg.limit_bytes is None:
        return "ok"
    if job.monotonic != memo.group_read:
        memo.group_read = job.monotonic
        memo.group_reads.append((job.monotonic, cg.refault_bytes, cg.major_faults, cg.usage_bytes, cg.limit_bytes))
        signals = group_signals(cg, thrashing(memo.group_reads))
        if signals is not None:
            memo.group_pressure = next_state(memo.group_pressure, signals, job.monotonic, cfg)
    return memo.group_pressure.level


def fuller_than_planned(pool: budget.Pool, cfg: PolicyConfig) -> float:
    """Free memory below which a job's own pool is critical: under 2 % of it
    (critical_available_ratio), and under half the margin its plan leaves free at its peak. A
    plan takes the pool to its margin (1 %) at a step's peak, so 2 % alone called every peak of
    a job at its plan critical: the embedding job, restarted at 9016 of 9465, was cut by a
    quarter three times in 30 steps."""
    return min(cfg.critical_available_ratio * pool.capacity_bytes, pool.margin_bytes / 2)


def share_for(session: SessionRecord, pool: budget.Pool, greedy: int, others: Others, at: float,
              ahead: int = 0) -> Optional[int]:
    """The session's fair share of its pool (budget.fair_share) beside the others, or None when
    it has the pool to itself. ``greedy`` is its budget as if alone but for the growth promised
    to the others (``pool.reserved_bytes``, ``ahead`` of it the outside's growth, which no session
    shares); what they hold now is theirs in it. The others' part is read from the pool's sorted
    claims (claims.Claims.kept)."""
    if not others.number:
        return None
    room = greedy + pool.reserved_bytes - ahead + others.held
    own = pool.own_bytes if pool.own_bytes is not None else session.peak_held_at(at)
    return budget.share_beside(room, own, others.number, others.kept)


def curve_for(session: SessionRecord, noise: float = NOISE, kills: bool = False):
    """The session's curve (``noise``: the peak spread assumed for its pool until its reports
    show their own; ``kills``: an overshoot there is a kill, see fit). Until the job's first
    report past its warm-up, a curve its earlier runs left (same job, pool and configuration:
    identify) is its curve, with source "remembered": the first plan starts from it, within
    the pool's room now and no higher than the batches those runs ran (controller). Once that
    report agrees with it (check_remembered), it joins the fit. Used only as a prior, it left
    every restarted job (a preempted Slurm job, a resumed run) at its default, to learn again."""
    if any(not o.warmup for o in session.observations):
        return fit(list(session.remembered) + list(session.observations), session.prior, noise, kills)
    remembered = fit(session.remembered, None, noise, kills) if session.remembered else None
    if remembered is not None:
        return replace(remembered, source="remembered")
    return fit([], session.prior)


def check_remembered(session: SessionRecord, first: Observation) -> None:
    """Keep a remembered curve only if it predicts this job's first real report."""
    if not session.remembered:
        return
    curve = fit(session.remembered)
    if curve is None or abs(curve.peak(first.batch) - first.peak_bytes) > AGREE * first.peak_bytes:
        session.remembered = []


def steadied(pool: budget.Pool, session: SessionRecord, job: Optional[JobMemory]) -> budget.Pool:
    """A host pool's room (free, what the trainer holds and what its workers own), as the larger
    of this job read's and the one before: a read that lands in a step's large free comes tens
    of MiB low (one in forty after the sampler's median), and a real drop shows in two reads in a
    row. The workers' memory is counted in both reads: free alone falls as they copy, and the
    free read as a rebuilt loader's old workers had gone, beside the new ones' pages, read
    0.12 GiB high (the benchmark's loop went from 115 to 207 on it)."""
    own = pool.own_bytes
    if pool.name != budget.HOST or own is None or job is None:
        return pool
    rooms = session.planner.rooms
    if len(job.processes) == 1:
        # A trainer alone: the shared memory of its group no process maps is the step's it just
        # unmapped, until the kernel frees it. Read as another's, a job whose steps held 0.7 GiB
        # of /dev/shm, its decisions made on the reads just after its steps, was budgeted that
        # much low and its plan swung 93 -> 226 -> 111 (bench/exam.py).
        own += job.unmapped_shmem_bytes
        pool = evolve(pool, own_bytes=own)
        workers = 0
    else:
        # The batches on their way from its workers (being collated, or queued where no process
        # maps them) are theirs too: with two workers at batch 600 they came and went by 19 MiB
        # at a time, 0-75 MiB, read to read.
        workers = sum(b for b in job.worker_bytes if b > 0) + (job.in_flight_shmem_bytes or 0)
    if not rooms or rooms[-1][0] != job.read_at:
        rooms.append((job.read_at, pool.capacity_bytes, pool.free_bytes + own, workers))
    room = max(r + w for _, capacity, r, w in list(rooms)[-2:] if capacity == pool.capacity_bytes)  # one pool's only
    return evolve(pool, free_bytes=max(0, room - workers - own))


def room_dip(pool: budget.Pool, session: SessionRecord, since: float) -> int:
    """How far below the room steadied() gives the pool's room fell in the reads since ``since``.
    Beside workers the room swings: the benchmark's loop that rebuilt its four workers at each
    change of batch read 2113-2307 MiB of room (free, the trainer and the workers' own memory)
    within a minute at one batch, as each fresh fork let go of the pages the trainer had since
    rewritten, which its old workers had shared and none of them owned. Growth on the highest
    read and a cut on the next low one moved its batch between 69 and 135 every few steps. The
    workers' own memory is left out: what they hold and will hold is their cost (worker_facts)."""
    reads = [(at, r + w) for at, capacity, r, w in session.planner.rooms if capacity == pool.capacity_bytes]
    if pool.own_bytes is None or not reads:
        return 0
    high = max(r for _, r in reads[-2:])
    return max(0, high - min(r for at, r in reads if at >= since))


def plan_session(session: SessionRecord, snapshot: Snapshot, host_level: str, sessions: Iterable[SessionRecord],
                 jobs: Dict[int, JobMemory], cfg: PolicyConfig) -> Decision:
    job = jobs.get(session.pid) if session.local else None
    pool = steadied(pool_for(session, snapshot, job, cfg), session, job)
    workers = worker_facts(session, job, cfg)
    if pool.kind == DISCRETE:
        workers = replace(workers, growth=0, count_held=True)  # workers grow in host memory, not on the GPU
    use = (lambda s: use_now(s, pool.name, snapshot, jobs)) if pool.own_bytes is not None else None
    others = neighbours(session, pool.name, sessions, snapshot.monotonic, use)
    ahead = growth_ahead(session, job, pool, others, cfg)
    # What the others claim (their plans' peaks, or what they hold if more) and what lies outside
    # every session: no budget passes the pool's limit less those (budget.Pool.bound_bytes).
    pool = pool.with_claimed(others.held + others.growth + ahead + (outside(pool, others) or 0))
    pool = pool.with_reserved(others.growth + workers.growth + ahead)
    held_now = session.peak_held_at(snapshot.monotonic if pool.own_bytes is None else float("inf"))
    greedy = pool.budget(held_now)
    pool = pool.with_share(share_for(session, pool, greedy, others, snapshot.monotonic, ahead))
    level = host_level
    if pool.name == budget.HOST and pool.free_bytes < fuller_than_planned(pool, cfg):
        level = "critical" if rank(level) < rank("critical") else level  # the job's own cgroup is nearly full
    group = group_level(session, job, cfg)
    if rank(group) > rank(level):
        level = group
    held = session.peak_held_at(snapshot.monotonic)
    if (pool.own_bytes is None and held == 0 and session.plan is not None and session.held
            and (session.held[-1][1] or 0) > 0 and session.held[-1][0] > snapshot.monotonic):
        # The job reported after this snapshot was taken and nothing before it: what it held
        # then is unknown, so free memory cannot be paired with it. Keep the plan for the
        # moment until the next sample (an interval away) sees the job's memory.
        return Decision(session.plan, session.state, session.budget_bytes, session.predicted_peak_bytes,
                        pool_budget_bytes=session.pool_budget_bytes)
    # A GPU's caching allocator may reserve more than a step needs (and an OOM there can be
    # caught); in host or unified memory every reported byte was used, and an overshoot kills.
    kills = pool.kind != DISCRETE
    curve = curve_for(session, cfg.peak_spread_gpu if pool.kind == DISCRETE else cfg.peak_spread_host, kills)
    # A job that ran on a GPU whose memory cannot be read now (lost, driver down) must not be
    # budgeted from host RAM, which may be far larger: no budget, so the plan holds.
    gpu_gone = session.pool not in (None, budget.HOST) and pool.name != session.pool
    # Nor a job on this host whose memory has not been read yet (the sampler is a step behind
    # on a loaded machine): its cgroup is unknown, and a CNN in a 1 GiB group budgeted from the
    # machine's 20 GB after three steps was planned 1776 where 665 fits, and killed. Before its
    # first report, the cgroup read at hello bounds it (its usage then is counted as used: the
    # budget errs low), so a job memd remembers starts from its curve, not from its default.
    # A job running already when it said hello (the daemon restarted) holds what it runs until
    # its memory is read: counted as used by someone else, its own memory cut it to batch 1.
    unread = session.local and pool.name == budget.HOST and (job is None or not job.alive) and (
        session.cgroup is None or bool(session.observations) or session.rejoined)
    # On a machine with GPUs, a job whose GPU cannot be told (several unlike GPUs, none named,
    # none used yet) is not budgeted from the host's RAM: two 80 GB GPUs on a 1 TB host gave a
    # first plan of 430 where 67 fits the GPU. It keeps its default until its GPU is known.
    gpu_unknown = snapshot.memory_model == DISCRETE and pool.name == budget.HOST and not on_cpu(session)
    # After an out-of-memory error, what the job holds is unknown until its next report, and the
    # pool's free memory cannot be paired with it: the budget paired before stands. Taken as 0,
    # the simulated job near capacity was budgeted without its own 30 GiB and cut to 5 where 21
    # fits; taken as its last peak, two jobs sharing a GPU each counted the other's memory as
    # their own and overshot it.
    kept = session.budget_bytes if pool.own_bytes is None and session.holding_unknown() else None
    since = job.monotonic - cfg.worker_horizon_seconds if job is not None else snapshot.monotonic
    dip = room_dip(pool, session, since) if workers.uss and pool.name == budget.HOST else 0
    decision = decide(
        curve, None if gpu_gone or unread or gpu_unknown else pool, session.limits, session.state, level, cfg,
        latest_peak=session.latest_peak, latest_batch=session.latest_batch,
        held_peak=held_now, settling=settling(session), budget_bytes=kept,
        workers=workers, grow_dip=dip, read=job.read_at if job is not None else snapshot.monotonic,
        steps=session.reports + len(session.remembered),  # the steps earlier runs showed count too
        base=session.held_before_steps if pool.name == budget.HOST else None,
        host_total_bytes=snapshot.system.total_bytes, host_free_bytes=snapshot.system.available_bytes,
    )
    if gpu_gone:
        decision = replace(decision, plan=replace(decision.plan, reason="holding %d: GPU %s cannot be read now (lost, "
                                                  "or the driver is down)" % (decision.plan.batch_size, session.pool)))
    elif gpu_unknown:
        decision = replace(decision, plan=replace(decision.plan, reason="%d: which GPU this job runs on is not known "
                                                  "yet (Session(device=...) names it)" % decision.plan.batch_size))
    elif unread and curve is not None:
        decision = replace(decision, plan=replace(decision.plan, reason="holding %d: this job's memory has not been "
                                                  "read yet" % decision.plan.batch_size))
    if curve is not None and pool is not None and not (gpu_gone or unread or gpu_unknown):
        # What it would plan for with the pool to itself: its room with the others' holdings and
        # claims left out. Read off its budget beside them, a newcomer squeezed by the first job's
        # claim wanted little, the first kept most of the pool, and three copies of one job in a
        # group ended at 61, 159 and 51 (bench/exam.py).
        room = pool.free_bytes + (pool.own_bytes or held_now) + others.held - pool.margin_bytes - ahead
        alone = curve.max_batch(max(0, room))
        if session.limits.max_batch is not None:
            alone = min(alone, session.limits.max_batch)
        session.wanted_peak_bytes = int(curve.peak(max(alone, session.limits.min_batch)))
    if session.unwatched is not None:  # its pid here is not its process: nothing of it is measured
        decision = replace(decision, plan=replace(decision.plan, reason="%s; %s: planned from its reports" % (
            decision.plan.reason, session.unwatched)))
    session.plan = decision.plan
    session.state = decision.state
    session.at_ceiling = decision.at_ceiling
    # Unknown while its GPU is: the job's peaks are not measured meanwhile (memd.ops.watch.measure_peak),
    # as host RSS would teach a GPU job's curve the wrong memory.
    was = session.pool
    session.pool = session.pool if gpu_gone else None if gpu_unknown else pool.name
    if session.pool_key is None and pool.name != budget.HOST and not gpu_gone:
        session.pool_key = pool_key(pool, snapshot) + comparable(session)  # its GPU was unknown at hello
    session.budget_bytes = decision.budget_bytes
    session.pool_budget_bytes = decision.pool_budget_bytes
    session.workers = workers if workers.uss or workers.cost else None
    session.predicted_peak_bytes = decision.predicted_peak_bytes
    record_claim(session, sessions, was, snapshot.monotonic, use)
    return decision


def worker_facts(session: SessionRecord, job: Optional[JobMemory], cfg: PolicyConfig) -> WorkerFacts:
    """The job's workers as the policy needs them. A worker that copies a Python-object dataset as
    it reads it (seed 004) grows step by step and levels off at a copy of it, and the job's workers
    all copy the same dataset: the job has one level. It is known once workers have levelled off
    (what they hold on average), or one has slowed enough for its course to tell
    (policy.growth.level_of, the most worked worker's word); each worker then costs the job's
    level, or what it holds and will add within GROWTH_AHEAD if it passes it. Until then each
    may come to all the anonymous memory it maps (0.6 GiB where the benchmark's workers level
    near 0.31), and that projection only stops the batch from growing
    (controller._beside_workers): what cuts it is evidence (``evident``), what the workers reached
    (as two of each one's latest three reads show: the most one reached, or once they levelled off
    what they reached together) and what the live ones hold and will add within GROWTH_AHEAD at a
    rate read over seconds (growth.RATE_SPAN). A level read off a
    course is a projection too, until a worker levels off. Fresh workers look cheap: taken at their
    own size, a loop that rebuilt its DataLoader at each change of batch was planned 342 beside four
    of them, and killed at 526 when they grew; taken at the projection, the same loop was told batch
    1 for its whole run, where its workers copied too slowly to ever show their level. What the live
    workers will add (``growth``) is held back from the batch's budget in a shared pool: a job with
    four growing workers was planned a batch that fit at the time, and the workers' growth killed it
    8 steps later. ``running``: the workers its loader runs, as the median of the counts read within
    the horizon."""
    memo = session.planner
    cpus: Optional[float]
    if job is not None and job.cpus:
        cpus = job.cpus / (session.local_world_size or 1)  # the node's ranks share its CPUs
    else:
        cpus = session.cpus  # the client's own count, already shared among the node's ranks
    uss = tuple(b for b in job.worker_bytes if b > 0) if job is not None else ()
    if job is not None and job.monotonic != memo.workers_read:
        memo.workers_read = job.monotonic
        # A worker can come to own at most its anonymous pages by copying them (its libraries'
        # pages stay shared); RSS where they are unknown.
        now = {p.pid: p for p in job.processes if p.pid != job.pid}
        for pid in list(memo.worker_reads):
            if pid not in now:  # gone: a rebuilt loader forks new ones, which copy the same again
                del memo.worker_reads[pid]
                memo.worker_courses.pop(pid, None)
                memo.worker_raw.pop(pid, None)
                memo.worker_inherited = max(memo.worker_inherited, memo.worker_projected.pop(pid, 0))
        seen = []
        settled: List[Tuple[bool, float, int]] = []  # what the workers that levelled off say
        levelled_before = memo.worker_level is not None and memo.worker_level[0]
        for pid, proc in list(now.items())[:MAX_WORKERS]:
            rss = proc.rss_bytes or 0
            held = proc.own_bytes
            reads = memo.worker_reads.setdefault(pid, collections.deque(maxlen=WORKER_READS))
            if session.follows_workers and levelled_before and held is not None:
                # A loader that follows the plan has its batches in flight costed apart, the one a
                # worker builds among them (controller._in_flight): its worker is read at rest, the
                # least of its latest three reads. Read building batches (376.1 and 376.0 MiB
                # beside a level of 343.5, two reads of three), MemdLoader's worker was costed that
                # again, and the plan went 932 -> 902 and stayed there; the least of three never
                # passed its level. A worker that grows shows once it rests higher.
                raw = memo.worker_raw.setdefault(pid, collections.deque(maxlen=3))
                raw.append(held)
                held = min(raw)
            if len(reads) >= 2 and reads[-1][0] - reads[-2][0] < READ_GAP:
                reads[-1] = (job.monotonic, proc.cpu_seconds, held)  # the latest, the older ones spaced
            else:
                reads.append((job.monotonic, proc.cpu_seconds, held))
            course = memo.worker_courses.setdefault(pid, [])
            if proc.cpu_seconds is not None:
                keep(course, proc.cpu_seconds, held)
            bound = proc.anon_bytes if proc.anon_bytes is not None else rss
            one = growth(reads, bound, cfg.worker_horizon_seconds, course)
            if one.level is not None:  # a levelled worker's word on the job's level, else the most worked one's
                told = (one.levelled, course[-1][0] - course[0][0] if course else 0.0, one.level)
                if one.levelled:
                    settled.append(told)
                elif memo.worker_level is None or told[:2] >= memo.worker_level[:2]:
                    memo.worker_level = told
            # What it reached: the middle of its latest three reads, as one read may catch it holding a
            # batch's samples in its heap. Taken from any one read, a worker of the two-workers job
            # read at 351.7 MiB beside the other's 343.6 cost both 8 MiB more for the rest of the
            # run and cut its batch 605 -> 586.
            reached = statistics.median_low(r[2] for r in list(reads)[-3:])
            seen.append((pid, held, one, bound, reached))
        if settled:
            # The workers that levelled off say it together: what they hold on average, with the
            # most worked one's standing. Told by the most worked one alone, the level became one
            # worker's 316.4 MiB beside three at 312.6-315.1, every worker was costed that, and
            # the benchmark's loop was cut 126 -> 119 -> 112 -> 110 -> 108 within 23 s.
            told = (True, max(t[1] for t in settled), _mean([t[2] for t in settled]))
            if memo.worker_level is None or told[:2] >= memo.worker_level[:2]:
                memo.worker_level = told
        # ``reached``: what the live workers hold now, not the most any worker held this run. Kept
        # as a run's most, two reads of a worker collating a batch (315.6 MiB) cost each of the
        # four-workers loop's workers that much for the rest of its run, 550 s in which all four
        # held 313.1-313.2 and levelled at 313.2: 10 MiB of its batch's budget held back for
        # nothing, its batch cut 135 -> 119 while its group's use stayed at 2018-2034 of 2048 MiB.
        level = memo.worker_level[2] if memo.worker_level is not None else None
        levelled = memo.worker_level is not None and memo.worker_level[0]
        # Read off a course, the level may lie COURSE_ERROR low: growth goes by its upper end. In
        # 2 GiB beside four workers, 4 % low (a course read 306.8 MiB) let a batch of 155-161 where
        # 138 fits, and the cuts that followed rebuilt the loop's loader every 30-60 s.
        upper = None if level is None else level if levelled else int(level * (1 + COURSE_ERROR))
        ahead = copying = 0
        passing = False
        projected_each, evident_each = [], []
        for pid, held, one, bound, reached in seen:
            # What it adds within GROWTH_AHEAD at its rate; a fresh fork's first burst is no course,
            # but while it lasts the room read beside it runs high (controller._growth_beside_workers).
            rushing = int(min(one.rate * GROWTH_AHEAD, max(0, one.projected - held)))
            soon = rushing if one.sustained else 0
            if level is not None and held < level:
                # It copies the dataset the others did and stops at their level: its rate, read
                # while it copies fastest, is no line to draw past it.
                soon = min(soon, level - held)
            copying += rushing
            # Past the level a worker levelled off at, it ends the copy the others ended: that
            # level was read at another batch, or a worker's few MiB ago, and a loop that rebuilds
            # its loader at each change copies fast to the end. What it adds there is a projection
            # (it stops growth, and is not held back from the pool) until two of its latest three
            # reads show it (``reached``: one read may catch it collating a batch). Taken
            # at its rate, four workers past a level of 312.6 MiB read at batch 91 were costed
            # 315-318 where they level at 313-316, and the benchmark's loop was cut
            # 122 -> 120 -> 116 -> 110 -> 106 within 250 s, a rebuild each.
            past = levelled and level is not None and level <= held <= level * (1 + COURSE_ERROR) and soon > 0
            passing = passing or past
            if upper is not None:
                # The workers copy the same dataset: each costs the job's level, or more as it passes it
                # (a fresh one's own course, a burst, once read 0.49 GiB where they level at 0.31).
                memo.worker_projected[pid] = max(upper, held + soon)
            else:  # it may come to all it maps: a worker 3 s old grows at no telling rate yet
                memo.worker_projected[pid] = max(bound, held)
            evident_each.append(max(reached, 0 if past else held + soon))  # past: what it reached
            projected_each.append(memo.worker_projected[pid])
            ahead += 0 if past else soon
        # Until a worker levels off, each costs what the most costly one does: they copy the same
        # dataset, and one ahead shows where the others are going. Once one has, each costs the
        # level or its own more: one collating a batch, or keeping a few MiB more of heap, holds
        # them alone. Costed at the most one held, four workers in 2 GiB at 312.3, 312.3, 315.1
        # and 312.4 MiB (1252 together) were costed 1260, and the benchmark's loop was cut
        # 130 -> 122; in three runs of 2400 steps at 129 the four held at most 9-16 MiB above
        # their level together, where four times the most one held above it reached 28.
        each = _mean if levelled else _most
        floor = (level or 0) if levelled else 0
        reached = each([max(floor, r) for *_, r in seen])
        projected = each(projected_each)
        evident = each([max(floor, e) for e in evident_each])
        if level is not None:
            memo.worker_inherited = 0
        # A projection is a line drawn through a worker's latest reads, and a read that caught it
        # collating (its batch's samples in its heap) drew one steep enough to cut for a plan: two
        # workers' cost read 0.36-0.39 GiB each for one plan, 0.32 before and after, and each such
        # cut rebuilt the benchmark's loader. As the room takes a drop (steadied), the cost takes a
        # projection when two reads in a row show it; what a worker reached counts at once.
        lasting = projected if memo.worker_projected_last is None else min(projected, memo.worker_projected_last)
        memo.worker_projected_last = projected
        # Between two loaders no worker lives: the level stands for the next ones.
        memo.worker_cost = max(reached, lasting, memo.worker_inherited, upper or 0)
        # Read off a course, a level is still a projection (it erred 3-8 % high on the recorded
        # traces, 4 samples of the benchmark's flat CNN a MiB): it stops growth, and only a worker
        # that did level off makes it evidence that may cut.
        # Past the level, what a worker reached is evidence and what it will add is not (``past``).
        memo.worker_evident = evident if passing or not levelled else 0  # levelled: at the level at least
        memo.worker_growth, memo.worker_copying = ahead, copying
        memo.worker_counts.append((job.monotonic, len(now)))
        memo.queued.append((job.monotonic, job.in_flight_shmem_bytes or 0, session.latest_batch or 0))
    since = job.monotonic - cfg.worker_horizon_seconds if job is not None else math.inf
    recent = [n for at, n in memo.worker_counts if at >= since]
    return WorkerFacts(cpus=cpus, uss=uss, cost=memo.worker_cost or None, batch_bytes=session.batch_bytes,
                       evident=memo.worker_evident or None,
                       running=int(statistics.median_low(recent)) if recent else None,
                       newest=recent[-1] if recent else None, read=memo.workers_read if job is not None else None,
                       growth=memo.worker_growth if job is not None else 0,
                       copying=memo.worker_copying if job is not None else 0, follows=session.follows_workers,
                       queued=memo.queued[-1][1] if job is not None and memo.queued else 0,
                       queued_high=max((q for at, q, _ in memo.queued if at >= since), default=0),
                       queued_per_sample=max((q / b for at, q, b in memo.queued if at >= since and b), default=0.0),
                       batch_size=session.latest_batch if session.batch_bytes else None,
                       count_held=job is None or (len(memo.worker_counts) >= 2 and
                                                  memo.worker_counts[-1][1] == memo.worker_counts[-2][1]),
                       level=memo.worker_level[2] if memo.worker_level is not None else None,
                       levelled=memo.worker_level is not None and memo.worker_level[0])


def _mean(values: List[int]) -> int:
    return sum(values) // len(values) if values else 0


def _most(values: List[int]) -> int:
    return max(values, default=0)


def settling(session: SessionRecord) -> bool:
    """The planned batch has not run twice yet: the job's latest report is its first there since
    a change, or is still below it (a loader delivers the batches it prefetched at the old size
    first), so growth waits for what the planned batch costs (the report that ends it is decided
    on at once: memd.ops.session_ops.as_planned)."""
    last = session.observations[-1] if session.observations else None
    planned = session.state.batch
    return last is not None and planned is not None and (
        last.batch < planned or last.settling and last.batch == planned)


def prior_from_hints(hints: Dict[str, object]) -> Optional[Prior]:
    """The job's a-priori curve from its hints (explicit line, architecture or LLM): see
    memd.policy.estimate.prior_from_hints; None when the hints give nothing usable."""
    return estimate.prior_from_hints(hints)

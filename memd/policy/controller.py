"""The Plan: which batch, accumulation, workers and prefetch a job should use now, and why.

A pure function of (the job's learned curve, its pool, its limits, its control state, the
pressure level, the config). Moves, in order:
1. the curve's largest batch under the pool's budget (none before the first report: the job's
   default, or half what a prior allows: never a blind jump on a prior alone);
2. after an OOM: cut 25 % and never exceed the ceiling (the failed batch minus one); hold the
   cut until ``stable_steps`` clean reports, then grow back toward the ceiling, halving the
   distance with each report;
3. pressure: elevated and high hold growth, high also trims workers and prefetch, critical cuts
   the batch once per episode by the same 25 % and sets ``throttle``;
4. the job's min/max, then the effective-batch rule (split_batch).
Every plan carries a one-line reason that names the move that decided it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Tuple

from memd.client.plan import Plan, make_plan, split_batch
from memd.config import PolicyConfig
from memd.units import GiB  # human output is in GiB

from .budget import Pool, host_free, margin
from .fit import Curve, largest
from .frozen import evolve
from .invariants import keep_promises
from .pressure import rank

SURE = 0.7  # below this fit confidence, growth past the batches seen is ramped, not jumped
# The first batch of a job that gave no default, no target and no hint a prior can be drawn
# from. Not 1: one sample's step is mostly the framework's memory (a CPU torch job's whole 0.36
# GB at batch 1), so it teaches nothing of a sample's cost and leaves no smaller batch to
# measure the slope against (the probe below halves the batch); 8 does both, and grows from there.
FIRST_BATCH = 8


@dataclass(frozen=True)
class Limits:
    min_batch: int = 1
    max_batch: Optional[int] = None
    default_batch: Optional[int] = None
    target: Optional[int] = None  # the effective batch to keep
    num_workers: Optional[int] = None  # what the job would like (hint)
    prefetch_factor: Optional[int] = None


@dataclass(frozen=True)
class WorkerFacts:
    """What is known of a job's dataloader workers: the planner measures, the policy decides."""
    cpus: Optional[float] = None  # CPUs one rank's trainer may use (affinity, cgroup quota, ranks on the node)
    uss: Tuple[int, ...] = ()  # each live worker's own memory now
    cost: Optional[int] = None  # what one worker has reached this run, or is growing to (per_worker_cost)
    batch_bytes: Optional[int] = None  # one batch's tensors, as the loader delivered it
    growth: int = 0  # what the live workers are on their way to add (held back from the batch's budget)
    copying: int = 0  # the same at their latest rate, a fresh fork's first burst too (growth waits on it)
    follows: bool = False  # the job's loader runs the workers the plan keeps (MemdLoader)
    # While ``cost`` is a projection to what a worker maps (their level not known yet): one
    # worker's cost from evidence alone, the most any reached or a live one's own memory and its
    # growth ahead. The projection then only stops growth; evidence alone cuts (_beside_workers).
    evident: Optional[int] = None
    # How many workers the job's loader runs: the median of the counts read within the horizon, as
    # a loop that rebuilds its DataLoader has none for a moment, or its old and new ones at once.
    running: Optional[int] = None
    newest: Optional[int] = None  # the count in the latest read: workers still being started show there first
    read: Optional[float] = None  # when the workers were read (a cut on what they will add waits for the next read)
    # The batches on their way from the workers to the trainer (shared memory a worker collating
    # alone maps, or no process maps), now and at the most within the horizon (_queue).
    queued: int = 0
    queued_high: int = 0
    # Where the job's workers level off (planner.worker_facts), and whether one did (else it was
    # read off a worker's course): shown, not planned on (cost and evident carry it).
    level: Optional[int] = None
    levelled: bool = False
    # What grows with the batch beside the workers (_per_sample): the most the queue held per
    # sample of the batch the job ran within the horizon.
    queued_per_sample: float = 0.0
    batch_size: Optional[int] = None  # the batch whose tensors batch_bytes measured
    # The latest two reads of the job counted as many workers: False while its loader starts or
    # replaces them (and on the first read), when the count says nothing of what it will run.
    count_held: bool = True


@dataclass(frozen=True)
class ControlState:
    batch: Optional[int] = None  # the batch size of the last plan
    ceiling: Optional[int] = None  # largest batch allowed since an OOM
    stable: int = 0  # clean reports since the last cut
    critical_cut: bool = False  # the batch was already cut in the current critical episode
    # (a batch whose own steps stopped fitting this run, the batch the plan moved down to, the
    # budget then): the plan grows no further than the second until the budget grows, so a job
    # whose peaks straddle its budget settles instead of trying the edge again and again.
    cap: Optional[Tuple[int, int, int]] = None
    cut_on: Optional[float] = None  # the read of the workers the latest cut beside them was decided on
    # The batch's budget at each of its workers' latest reads (the read, the lowest budget at it):
    # a cut under min_gain beside workers goes by a budget that lasts (_lasting).
    budgets: Tuple[Tuple[float, int], ...] = ()
    workers: Optional[int] = None  # the workers the last plan kept beside the batch (_beside_workers)
    pending: Optional[Tuple[int, float, int]] = None  # a deep cut one read asked for (invariants.Kept.pending)
    killed: Optional[int] = None  # a batch the kernel's OOM killer ended a run of this job at
    budget: Optional[int] = None  # the batch's budget the last plan was made on (invariants.keep_promises)


@dataclass(frozen=True)
class Decision:
    plan: Plan
    state: ControlState
    budget_bytes: Optional[int]
    predicted_peak_bytes: Optional[float]
    at_ceiling: bool = False  # the OOM ceiling held the batch down (a run held there counts toward lifting it)
    # The pool's budget for the job, its workers' share included (budget_bytes is the batch's part)
    pool_budget_bytes: Optional[int] = None


def after_report(state: ControlState, batch: int) -> ControlState:
    """A clean step at ``batch``."""
    return evolve(state, stable=state.stable + 1 if batch == state.batch or state.batch is None else state.stable)


def after_oom(state: ControlState, batch: int, limits: Limits, cfg: PolicyConfig) -> ControlState:
    """An OOM at ``batch``: the ceiling drops below it and the batch is cut by ``oom_cut``."""
    ceiling = max(limits.min_batch, batch - 1)
    if state.ceiling is not None:
        ceiling = min(ceiling, state.ceiling)
    cut = max(limits.min_batch, int(batch * (1 - cfg.oom_cut)))
    return ControlState(batch=min(cut, ceiling), ceiling=ceiling, stable=0, critical_cut=state.critical_cut,
                        workers=state.workers, killed=state.killed)


def decide(curve: Optional[Curve], pool: Optional[Pool], limits: Limits, state: ControlState, level: str,
           cfg: PolicyConfig, latest_peak: Optional[int] = None, latest_batch: Optional[int] = None,
           workers: Optional[WorkerFacts] = None, host_total_bytes: Optional[int] = None,
           host_free_bytes: Optional[int] = None, held_peak: Optional[int] = None,
           settling: bool = False, budget_bytes: Optional[int] = None, grow_dip: int = 0,
           read: Optional[float] = None, steps: Optional[int] = None, base: Optional[int] = None) -> Decision:
    """``held_peak``: what the job held (in its reported units) when the pool's free memory was
    measured; by default its latest peak. ``settling``: the latest report is the first at its
    batch since a change (fit.Observation.settling). ``budget_bytes``: the budget to keep instead
    of the pool's, when what the job holds is unknown and the pool's free memory cannot be paired
    with it. ``grow_dip``: how much lower the pool's room was within the horizon; growth waits
    for room at the lowest (planner.room_dip), while a cut goes by the room now. ``read``: when the
    pool was read (a deep cut waits for a second read: invariants.keep_promises, which bounds
    every plan last); ``steps``: the reports the job made this run (its first spike_steps leave
    room for a rarer step: invariants, 4.); ``base``: what its trainer held before its first step."""
    budget: Optional[int]
    if budget_bytes is not None:
        budget = budget_bytes
    else:
        budget = pool.budget(latest_peak if held_peak is None else held_peak) if pool is not None else None
    pool_budget = budget
    current = state.batch
    kept = unproven = None
    at_ceiling = False
    as_they_are = None  # the budget beside workers if they stopped growing now (their growth is held back in it)
    if budget is not None and curve is not None and pool is not None and pool.kind != "discrete" and workers:
        as_they_are = budget + workers.growth if workers.uss else None
        budget, kept, unproven = _beside_workers(limits, workers, curve, budget, grow_dip, current or latest_batch,
                                                 cfg.min_gain, state.workers)
    budgets = state.budgets
    if workers is not None and workers.read is not None and budget is not None:
        budgets = _lasting(budgets, workers.read, budget)
    limit, reason = _memory_move(curve, budget, limits, current, latest_peak, latest_batch, cfg, state.killed)
    evidence: Optional[int] = None
    cap = state.cap
    if cap is not None and budget is not None and budget > cap[2] * (1 + cfg.min_gain):
        cap = None  # the pool grew (another job left): the batch that stopped fitting may fit now
    if current is not None and budget is not None and curve is not None:
        capped, line = cap, limit
        outgrown = latest_batch == current and curve.kills
        clear = _clear_of(curve, latest_peak, budget, current) if outgrown else current
        limit, reason, cap = _steady(limit, reason, current, outgrown, settling, cap, budget, cfg, clear, curve.noise,
                                     _growth_gain(workers, cfg))
        spare = pool.spare_bytes if pool is not None else 0
        lasting = max([budget] + [b for _, b in budgets])
        if (workers is not None and workers.uss and outgrown and latest_peak is not None
                and latest_peak <= lasting + spare and limit < current and current * (1 - cfg.min_gain) <= line
                and not reason.startswith("probing")):
            # Its steps there fit, and a loop beside workers rebuilds its loader at each change
            # of batch, each rebuild a little dearer than the last (its fresh workers copy their
            # dataset again, and levelled 313.7 -> 320 MiB over six): a line tilting up by that
            # asked for a sample or two at a time, and the benchmark's loop went 124 -> 123 ->
            # 121 -> 119 -> 118 -> 117 -> 116 -> 115 in 30 s, its steps within the budget each
            # time. Nor does the spread the job showed send it further while its step fits: the
            # loop went 116 -> 109 -> 103 on it, its steps 3-4 MiB inside the budget. A cut the
            # line puts under min_gain waits for a step that passes the budget and the margin's
            # spare part (Pool.spare_bytes). With its steps past the budget by 0.1-2.6 MiB, such cuts
            # took the loop 127 -> 123 -> 121 -> ... -> 108 in 650 s, one each loader life, its
            # group's free memory at 12 MiB or more, and gave back nothing: in another run what the
            # batch, its workers and their queue needed came to 2138.1 MiB at 120 and 2140.0 at
            # 115, each rebuild's workers dearer than the last. Nor does a budget one worker's
            # heap lowered for a read or two (_lasting).
            if latest_peak <= budget:
                within = "within the %.2f GiB budget" % (budget / GiB)
            elif latest_peak <= budget + spare:
                within = "past the %.2f GiB budget only into the %.3f GiB of margin its group's file pages no " \
                    "longer need" % (budget / GiB, spare / GiB)
            else:
                within = "past the %.3f GiB budget of its workers' latest read, within the %.3f GiB of a read " \
                    "a few seconds before" % (budget / GiB, lasting / GiB)
                if latest_peak > lasting:
                    within += " and the %.3f GiB of margin its group's file pages no longer need" % (spare / GiB)
                within += " (a worker collating a batch holds more for a moment)"
            limit, reason, cap = current, "keeping %d: its latest step peaked at %.2f GiB, %s, and a cut under " \
                "%.0f %% is not worth a change of batch (each one restarts its workers' copying)" % (
                    current, latest_peak / GiB, within, 100 * cfg.min_gain), capped
            evidence = latest_peak  # the batch's own step is its prediction (invariants: 1.)

    if workers is not None and current is not None:
        limit, reason = _growth_beside_workers(limit, reason, current, workers, unproven, grow_dip, curve, budget,
                                               limits, latest_peak, latest_batch, cfg)
        if (limit < current and as_they_are is not None and workers.read is not None and state.cut_on == workers.read
                and latest_batch == current and latest_peak is not None and latest_peak <= as_they_are):
            # A cut on what the workers will add (a projection of their latest read) waits for the
            # next read: that read shows what the cut gave back (a loop that rebuilds its loader
            # starts its workers over), and the batch fits beside them as they are. Three reports
            # on one read cut the benchmark's loop 130 -> 65 -> 32 -> 1 within a second, where its
            # fresh workers then copied too slowly to show their level.
            limit, reason = current, "keeping %d: cut to it on its workers' latest read; the next read shows " \
                "what the cut gave back" % current
            evidence = latest_peak  # its step fits beside the workers as they are (invariants: 1.)

    if state.ceiling is not None:
        if state.batch is not None and limit > state.batch:
            if state.stable < cfg.stable_steps:
                limit, reason = state.batch, "%d after an out-of-memory error, held until %d stable steps " \
                    "(%d so far)" % (state.batch, cfg.stable_steps, state.stable)
            else:  # back toward the ceiling in halving steps: the OOM said the room ends somewhere below it.
                # Halving the distance to the moves' own limit too, a restart after a kill went 1 -> 2
                # -> 3 -> 5 -> 8 -> 12 where each move could double, and ended short (bench/exam.py).
                step = state.batch + max(1, (state.ceiling - state.batch + 1) // 2)
                if step < limit:
                    limit, reason = step, "growing back to %d from %d, toward the ceiling %d, after %d stable steps" % (
                        step, state.batch, state.ceiling, state.stable)
        if limit > state.ceiling:
            limit, reason = state.ceiling, "at the ceiling %d below the batch that ran out of memory" % state.ceiling
            at_ceiling = True

    critical_cut = state.critical_cut
    if level != "critical":
        critical_cut = False
    if rank(level) >= rank("elevated") and current is not None and limit > current:
        limit, reason = current, "holding %d: memory pressure is %s" % (current, level)
    if level == "critical" and current is not None and not critical_cut:
        cut = max(limits.min_batch, int(current * (1 - cfg.oom_cut)))
        if cut < limit:
            limit, reason = cut, "cut to %d from %d: memory pressure is critical" % (cut, current)
        critical_cut = True

    promised = keep_promises(limit, reason, current, curve, budget, limits.min_batch, level, cfg,
                             kills=curve is not None and curve.kills, read=read, pending=state.pending,
                             evidence=evidence if limit == current else None, before=state.budget, steps=steps,
                             base=base)
    limit, reason, budget = promised.limit, promised.reason, promised.budget

    # Every reason leads with the plan's own batch: a move that allowed another number says so
    # after it ("growing back to 96" while the batch stays 64 read as a move that did not happen).
    if limits.max_batch is not None and limit > limits.max_batch:
        limit, reason = limits.max_batch, "%d, the job's max_batch (memory allows more: %s)" % (
            limits.max_batch, reason)
    if limit < limits.min_batch:
        limit, reason = limits.min_batch, "%d, the job's min_batch, though even it may not fit (%s)" % (
            limits.min_batch, reason)
    batch, steps, note = split_batch(limit, limits.target, limits.min_batch)
    if note:
        reason = "%d: %s (%s)" % (batch, note, reason) if batch != limit else reason + "; " + note
    elif batch != limit:
        reason = "%d x %d keeps the effective batch at %d, the largest such split within %d (%s)" % (
            batch, steps, batch * steps, limit, reason)
    elif steps > 1:
        reason += "; %d x %d keeps the effective batch at %d" % (batch, steps, batch * steps)

    num_workers, prefetch, worker_note = _workers(limits, workers or WorkerFacts(), pool, level, host_total_bytes,
                                                  host_free_bytes, cfg, kept)
    if worker_note:
        reason += "; " + worker_note
    plan = make_plan(batch, steps, num_workers, prefetch, reason=reason, source="daemon", pressure=level,
                     throttle=level == "critical",
                     fresh_for=cfg.plan_fresh_seconds if level == "ok" else cfg.plan_fresh_seconds / 4)
    predicted = curve.upper(batch) if curve is not None else None
    if promised.evidence is not None and batch == current:
        predicted = promised.evidence
    cut_on = state.cut_on
    if workers is not None and as_they_are is not None and current is not None and batch < current:
        cut_on = workers.read
    new_state = evolve(state, batch=batch, critical_cut=critical_cut, cap=cap, cut_on=cut_on, budgets=budgets,
                       workers=state.workers if kept is None else kept, pending=promised.pending, budget=budget)
    return Decision(plan, new_state, budget, predicted, at_ceiling, pool_budget)


# The workers' reads a budget must last for a cut under min_gain (_lasting): a worker caught
# collating a batch shows in what it reached for two reads (planner.worker_facts, the middle of
# three), and so lowers the budget for two.
LASTING_READS = 3


def _lasting(budgets: Tuple[Tuple[float, int], ...], read: float, budget: int) -> Tuple[Tuple[float, int], ...]:
    """The batch's budget at its workers' latest LASTING_READS reads, the lowest at each. A cut
    of a sample or two beside workers goes by the highest of them. In 2 GiB, the four-workers
    loop's steps at 135, 131, 129, 127, 126, 124 and 122 each passed one read's budget by
    0.1-0.7 MiB, where one of the two reads before had left 0.9-3.1 MiB to spare (at 126: one
    worker at 316.4 MiB beside three at 313.1, collating a batch). Each cut rebuilt its loader
    and gave back about 1 MiB (a batch size new to the trainer costs it about as much), its fresh
    workers levelled higher, and it went 135 -> 120 in 600 s, its group's use 12 MiB or more
    under the limit at its reads where runs of 2400 steps at 129 left 3-16 at the least. A
    budget that stays low for LASTING_READS reads cuts."""
    if budgets and budgets[-1][0] == read:
        return budgets[:-1] + ((read, min(budgets[-1][1], budget)),)
    return (budgets + ((read, budget),))[-LASTING_READS:]


def _growth_beside_workers(limit: int, reason: str, current: int, workers: WorkerFacts, unproven: Optional[int],
                           dip: int, curve: Optional[Curve], budget: Optional[int], limits: Limits,
                           latest_peak: Optional[int], latest_batch: Optional[int],
                           cfg: PolicyConfig) -> Tuple[int, str]:
    """Where growth waits beside dataloader workers; cuts never do. Until the workers show their
    level, their projection to all they map caps it (``unproven``, _beside_workers). While they
    copy fast it waits: the pool and the workers are read apart (the group every sample, each
    worker's pages at the job's read), and while fresh workers copied tens of MiB a second their
    room read 0.14 GiB high at the moment the benchmark's loop was planned 209 where 87 had just
    fit. And it goes no further than the lowest room within the horizon (``dip``, planner.room_dip).
    Nor does it probe below the batch while the projection holds growth: the slope a probe
    measures is of no use until the workers level off, and a loop that rebuilds its loader at a
    change of batch restarts their copying (the benchmark's loop probed 16 from 32 when its
    workers held 0.22 GiB each; its new ones started over at 0.04 and held it at 16 for the
    150 steps left)."""
    if unproven is not None and unproven <= current and limit < current and reason.startswith("probing"):
        return current, _still_copying(current, workers)
    # Until a worker levels off, a loop that keeps its own DataLoader copies its dataset again at
    # each change of batch: a move, capped or not, must gain a quarter.
    before_level = bool(workers.uss) and not workers.levelled and not workers.follows
    gain = BEFORE_LEVEL_GAIN if before_level else _growth_gain(workers, cfg)
    if limit > current and before_level and limit < current * (1 + gain):
        # A loop that keeps its own DataLoader rebuilds it at each change of batch, and its fresh
        # workers copy their dataset again: until one levels off, a small move only puts off the
        # level the last move is planned on. Four workers' course read 313.5 MiB, and 8 % above
        # it left the loop room for a few samples at a time: it went 32 -> 33 -> 34 -> 37 -> 39
        # -> 41 -> 45 -> 47 over 130 s, a rebuild each, and its workers never levelled off.
        return current, "keeping %d: %d would fit, but until its workers level off growth waits for a gain of %.0f " \
            "%% (each change of batch starts their copying over)" % (current, limit, 100 * BEFORE_LEVEL_GAIN)
    if limit > current and workers.uss and not workers.count_held:
        # The benchmark's loop, read as its loader forked the first of its four workers, was
        # planned 32 -> 66 -> 132 beside that one; at 132 its four fresh workers copied 27 MiB a
        # second each, and their growth cut it to 1, where they copy too slowly to show their level.
        return current, "keeping %d: its loader is starting its workers, and growth waits until their number " \
            "holds" % current
    # A cap below goes by the same gain as the move it caps: each change rebuilds the loop's
    # loader, and capped moves of 3-12 % before its workers levelled off took the benchmark's
    # loop 33 -> 36 -> 42 -> 47 -> 50 -> 52 -> 54 in 6 s, and 95 -> 107 -> 110 -> 111 after.
    if unproven is not None and limit > max(current, unproven):
        # Capped below min_gain, the move is not worth the rebuild: the benchmark's loop went
        # 120 -> 122 on it, and its four workers started their copies over.
        limit = max(current, unproven) if unproven >= current * (1 + gain) else current
        reason = _still_copying(limit, workers)
    rushing = max(workers.growth, workers.copying)
    if limit > current and rushing > SETTLED * _running(workers) * (_per_worker(workers) or 0):
        return current, "keeping %d: its workers are still growing (%.2f GiB within seconds), and growth waits " \
            "until they settle" % (current, rushing / GiB)
    if dip > 0 and budget is not None and limit > current:
        low, _ = _memory_move(curve, budget - dip, limits, current, latest_peak, latest_batch, cfg)
        if low < current * (1 + gain):
            return current, "keeping %d: its room was %.2f GiB lower within the last %.0f s (its workers come and " \
                "go): growth waits for room that lasts" % (current, dip / GiB, cfg.worker_horizon_seconds)
        if low < limit * (1 - cfg.min_gain):
            return low, "%d: where its room was lowest within the last %.0f s (%.2f GiB below now, as its " \
                "workers come and go)" % (low, cfg.worker_horizon_seconds, dip / GiB)
    return limit, reason


def _still_copying(batch: int, workers: WorkerFacts) -> str:
    n = max(_running(workers), workers.newest or 0)
    if n == 1:  # one worker: "its worker is still copying their dataset ... until they level off each" misread
        return "holding %d: its worker is still copying its dataset, and until it levels off it may come to " \
            "%.2f GiB" % (batch, (_per_worker(workers) or 0) / GiB)
    return "holding %d: its %d workers are still copying their dataset, and until they level off each may come " \
        "to %.2f GiB" % (batch, n, (_per_worker(workers) or 0) / GiB)


def _steady(limit: int, reason: str, current: int, outgrown_here: bool, settling: bool,
            cap: Optional[Tuple[int, int, int]], budget: int, cfg: PolicyConfig, clear: Optional[int],
            spread: float, gain: float) -> Tuple[int, str, Optional[Tuple[int, int, int]]]:
    """Fewer, surer changes of batch: each costs the job a DataLoader rebuild, and the first step
    at a new size runs low, the next ones high. Growth waits for a second report at the batch and
    must gain min_gain. ``outgrown_here``: the latest report is at this batch, in a pool where an
    overshoot kills; if the job's own steps say the batch no longer fits, the plan moves down to
    where the curve says it fits, and at least to ``clear``, where the latest step's own peak and
    spread would fit (_clear_of), and the run stays there (on a GPU an overshoot is an
    out-of-memory error, and its ceiling remembers it; a cap there would also keep an allocator
    spike forever). Not further: a move of min_gain (3 %) answered moves that each raised a CPU
    job's peaks (a CNN's from 991 to 1121 MiB in eight), but with glibc's heap held steady
    (memd.client.heap) six small moves raised the CNN's peak at 700 by 6 MiB (1060 -> 1066), and
    the 3 % left the two-workers job at 605 where 623 fit. ``gain``: what growth must gain
    (_growth_gain). Returns (limit, reason, cap)."""
    if limit > current:
        if settling:
            return current, "keeping %d until a second step there: a batch's first step after a change runs low" % (
                current), cap
        if cap is not None and limit > cap[1]:
            if cap[1] <= current:
                return current, "keeping %d: %d stopped fitting this run" % (current, cap[0]), cap
            limit, reason = cap[1], "%d: %d stopped fitting this run" % (cap[1], cap[0])
        if limit < current * (1 + gain):
            return current, "keeping %d: %d would fit, a gain under %.0f %% is not worth a change of batch" % (
                current, limit, 100 * gain), cap
        return limit, reason, cap
    if limit < current and outgrown_here and not reason.startswith("probing"):
        # The job's own steps at this batch say it no longer fits: go below, and stay.
        if clear is not None and clear < limit and clear < current // 2:
            # Half at most: a line through batch sizes close together gave a job beside workers a
            # cost per sample of a fraction of a MiB and sent it from 16 to 1, where its steps
            # give back next to nothing more and its workers copy too slowly to learn from.
            limit, reason = max(1, current // 2), "down to %d, half of %d, which fits no longer: its latest step " \
                "plus the %.0f %% spread passes the %.2f GiB budget, and its line would go to %d" % (
                    max(1, current // 2), current, 100 * spread, budget / GiB, max(1, clear))
        elif clear is not None and clear < limit:
            limit, reason = max(1, clear), "down to %d, where it would fit: %d fits no longer, its latest step plus " \
                "the %.0f %% spread passes the %.2f GiB budget" % (max(1, clear), current, 100 * spread, budget / GiB)
        else:
            reason = "down to %d: %d fits no longer (%s)" % (limit, current, reason)
        cap = (current, limit, budget)
    return limit, reason, cap


def _clear_of(curve: Curve, peak: Optional[int], budget: int, current: int) -> int:
    """The batch at which a step that peaked at ``peak`` at ``current`` fits ``budget`` with the
    spread the curve assumes. Memory that rose at a constant batch (the allocator's history: a
    CNN job's peaks at 540 went from 995-1030 to 1146 MB and stayed) is given back only by
    fewer samples, at the curve's cost per sample; a fixed 3 % step gave back 18 MiB a move, and
    the job was killed two moves later."""
    if not peak or curve.per_sample_bytes <= 0:
        return current
    over = peak * (1 + curve.noise) - budget
    return current if over <= 0 else current - math.ceil(over / curve.per_sample_bytes)


def _memory_move(curve: Optional[Curve], budget: Optional[int], limits: Limits, current: Optional[int],
                 latest_peak: Optional[int], latest_batch: Optional[int], cfg: PolicyConfig,
                 killed: Optional[int] = None) -> Tuple[int, str]:
    """(limit, reason) from the curve and the budget alone. ``killed``: a batch at which the OOM
    killer ended a run of this job (ControlState.killed): its default counts for nothing then."""
    start = limits.default_batch or limits.target or max(limits.min_batch, FIRST_BATCH)
    if limits.max_batch is not None:
        start = min(start, limits.max_batch)
    if killed is not None and latest_batch is None and current is not None and (curve is None or budget is None):
        return current, "%d: a run of this job was killed at %d by the kernel's OOM killer; it starts from the " \
            "largest batch an earlier run completed a step at, at most half of that (else its min_batch), and " \
            "learns up" % (current, killed)
    if curve is None or budget is None:
        if curve is None and latest_batch is not None:
            # Only the first step reported: optimizers allocate their state on it.
            return current or start, "keeping %d: the first step's peak leaves out the optimizer's state; " \
                "learning from the second" % (current or start)
        if current is not None and current != start:
            return current, "keeping %d: no memory curve yet" % current
        if limits.default_batch or limits.target:
            return start, "starting at %d: no reports yet" % start
        return start, "starting at %d: no reports yet, and no default_batch, target or model hints (memd's " \
            "first batch is %d; it grows from the job's reports)" % (start, FIRST_BATCH)
    fits = curve.max_batch(budget)
    if curve.source == "remembered":
        # Earlier runs of this job in this pool learned it (and this run has not reported past
        # its warm-up yet): where they say it fits now, no higher than the largest batch they
        # ran, or than the job's own default if that is larger.
        asked = [] if killed is not None else [limits.default_batch or limits.target or FIRST_BATCH]
        ran = max([b for b, _ in curve.observed] + asked)
        first = max(1, min(fits, ran))
        return first, "%d from earlier runs of this job: predicted peak %.2f GiB of a %.2f GiB budget%s" % (
            first, curve.peak(first) / GiB, budget / GiB,
            "" if killed is None else " (one was killed at %d by the kernel's OOM killer)" % killed)
    if curve.source == "prior" and curve.batch_sizes == 0:
        # Only a prior: start no higher than the job's default, or half what the prior allows.
        first = min(start, fits) if limits.default_batch else max(limits.min_batch, fits // 2)
        return max(first, 1), (
            "starting at %d from the prior estimate (%.1f GiB fixed + %.2f GiB/sample, budget %.1f GiB)"
            % (max(first, 1), curve.fixed_bytes / GiB, curve.per_sample_bytes / GiB, budget / GiB))
    anchor = latest_batch or current or start
    if curve.source == "prior" and fits > anchor * cfg.max_growth:
        return int(anchor * cfg.max_growth), "ramping to %d from %d, toward %d (the curve still leans on the " \
            "prior)" % (int(anchor * cfg.max_growth), anchor, fits)
    widest = max((b for b, _ in curve.observed), default=anchor)
    if curve.source == "fit" and fits > widest * cfg.max_growth and (curve.confidence < SURE or curve.kills):
        # Few batch sizes and a slope the noise could explain (an allocator spike on one of two
        # reports flattens the line): grow by at most max_growth past the largest batch seen.
        # Where an overshoot kills, whatever the fit's confidence: a real GPT job's line through
        # batches 4 and 9 (confidence 0.75) planned 47 where 42 fits, as its small batches cost
        # less per sample than its large ones.
        grow = int(widest * cfg.max_growth)
        why = "per-sample cost not yet certain: confidence %.2f" % curve.confidence if curve.confidence < SURE else \
            "an overshoot here is a kill: at most %gx the largest batch seen" % cfg.max_growth
        return grow, "ramping to %d from %d, toward %d (%s)" % (grow, anchor, fits, why)
    batches = [b for b, _ in curve.observed]
    narrow = curve.source == "bound" or (
        curve.source == "fit" and curve.confidence < SURE and max(batches) < 2 * min(batches))
    if (narrow and fits <= anchor and latest_peak and latest_batch
            and budget - latest_peak >= 0.5 * latest_peak / latest_batch and anchor // 2 >= limits.min_batch):
        # No provable room, yet room left, and the batches seen are too close together to tell
        # fixed from per-sample cost (one batch: the bound p/b is pessimistic when much of p is
        # fixed). One step at half the batch (always safe) measures the real slope.
        probe = anchor // 2
        return probe, "probing %d, down from %d for one step, to learn the per-sample cost (%.2f GiB of the budget " \
            "unused)" % (probe, anchor, (budget - latest_peak) / GiB)
    peak = curve.peak(max(fits, 1))
    seen = dict(curve.observed).get(fits)
    if curve.line(max(fits, 1)) > budget and seen is not None:  # kept by its own steps there, not by the line
        return fits, "%d fits: its steps there peaked at %.2f GiB of a %.2f GiB budget" % (
            fits, seen / GiB, budget / GiB)
    if curve.source == "bound" and not curve.fixed_bytes:
        # One batch size: not a cost per sample learned, a bound that counts the job's whole
        # memory (the framework's too) as its samples'; the next batch size gives the slope.
        return fits, "%d fits: at most %.2f GiB of a %.2f GiB budget, counting all of the %.2f GiB at %d as its " \
            "samples' until a second batch size shows the cost of one" % (
                fits, peak / GiB, budget / GiB, (latest_peak or 0) / GiB, latest_batch or anchor)
    return fits, "%d fits: predicted peak %.2f GiB of a %.2f GiB budget (%s from %d batch size%s)" % (
        fits, peak / GiB, budget / GiB, curve.source, curve.batch_sizes, "" if curve.batch_sizes == 1 else "s")


# Workers about to add more than this share of what they cost together are still growing.
SETTLED = 0.1
# Until a worker levels off, growth beside workers that a change of batch restarts must gain this
# much (_growth_beside_workers).
BEFORE_LEVEL_GAIN = 0.25
# Growth of a loader that follows the plan (MemdLoader) must gain this much, not min_gain: it
# takes a larger batch without a rebuild, its workers keep what they copied, and a new size costs
# the trainer about 1 MiB (oneDNN's per-shape cache, bench/shapecost.py); a move of a few samples
# still waits. At min_gain the benchmark's loader sat 2-3 % below what fit: at 921 where 948 did,
# at 938 where 958 did for the 290 s that run went on.
FOLLOWING_GAIN = 0.01


def _growth_gain(workers: Optional[WorkerFacts], cfg: PolicyConfig) -> float:
    return min(cfg.min_gain, FOLLOWING_GAIN) if workers is not None and workers.follows else cfg.min_gain


# Seed 000's worker table for unified machines, used before any worker is measured.
_UNIFIED_WORKER_TABLE = ((128e9, 4), (64e9, 2), (0, 0))


def _wanted(limits: Limits, facts: WorkerFacts) -> int:
    """The workers the job asked for (a hint, Session(num_workers)), else one per CPU it may use."""
    if limits.num_workers is not None:
        return limits.num_workers
    return max(1, int(facts.cpus)) if facts.cpus else 0


def _running(facts: WorkerFacts) -> int:
    return len(facts.uss) if facts.running is None else facts.running


def _per_worker(facts: WorkerFacts) -> Optional[int]:
    return facts.cost or (int(statistics.median(facts.uss)) if facts.uss else None)


def _queue(limits: Limits, facts: WorkerFacts) -> Tuple[int, int]:
    """(what of the workers' queue comes back with no worker, one worker's share of it at its
    fullest). A worker collates each batch into shared memory and lets go of it when it sends
    it: on its way to the trainer a batch is in no process's memory, yet in the pool's use. With
    two workers at batch 600 that queue held 0-75 MiB from read to read, 57 or 75 most of the
    time (their four prefetch slots of 19 MiB). Read as free or not, it swung the room by as
    much; and a loader that says its batch's size had it counted twice, in use and again as each
    worker's prefetch_factor batches (seed 004). So the room counts it as the workers', and each worker
    costs its share of it at its fullest, or its prefetch slots when a batch's size is known.
    More than those slots hold is something else's (a dataset copied to /dev/shm): in use."""
    running = max(1, _running(facts))
    # A following loader's workers carry more than their prefetch (_in_flight), at its latest
    # batch's size while the fullest read may hold a larger batch's: against 2 slots, one worker's
    # 2 batches of 28.8-30.3 MiB (58.2-59.8 read) went in and out of use from read to read, and
    # the plan 982 <-> 929-958 with them.
    slots = running * _in_flight(limits.prefetch_factor or 2, facts) * (facts.batch_bytes or 0)
    if facts.batch_bytes and facts.queued_high > slots:
        return 0, 0
    return facts.queued, facts.queued_high // running


def _per_sample(limits: Limits, facts: WorkerFacts) -> float:
    """The bytes one sample adds to each worker's share beside the batch: it builds each batch
    from the samples it holds, then queues prefetch_factor batches on their way to the trainer.
    Read off the queue, or the batch's size a loader reports: the four-worker job's workers
    levelled at 311 MiB building batches of 32 and at 315 building 120 (32 KiB a sample), and
    their queue held 8 MiB at 32 and 30-34 at 138: costed as at 32, the job would grow 38 MiB
    past what the costs said by 138 (30 samples; 138 is 7 MiB below its kill line)."""
    asked = limits.prefetch_factor or 2
    if facts.batch_bytes and facts.batch_size:
        return facts.batch_bytes / facts.batch_size
    return facts.queued_per_sample / (max(1, _running(facts)) * asked)


def _in_flight(prefetch: int, facts: WorkerFacts) -> int:
    """The batches each worker has on their way to the trainer: its prefetch_factor; in a loader
    that follows the plan, one more queued and one it builds. The benchmark's MemdLoader at
    prefetch 1 and batch 680 (21 MiB) had 2-3 batches queued beside 2 workers (43-66 MiB) and a
    worker's heap 23-39 MiB above its level as it built one, up to 5.1 batches in all; costed at
    1 each, the batch had 1-4 MiB to spare and the kernel killed it. Beside 1 worker at 929-982
    (29-30 MiB) the queue held up to 2.1 batches and the building worker 1.1 more (3.2 in all);
    costed at 2, it was killed at 982 within 40 steps. Part of that was a batch a rebuild had left
    pinned in the new worker (MemdLoader no longer does, bench/rebuildpin.py), but MemdLoader at a
    fixed 980 beside 1 worker, never rebuilt, still read up to 78 MiB (2.5 batches) beyond the
    trainer's own. A loop's own loader at prefetch 2, costed at its 2, ran at the largest batch
    that fits (queued 3-4)."""
    return prefetch + 2 if facts.follows else prefetch


def _beside_workers(limits: Limits, facts: WorkerFacts, curve: Curve, budget: int, dip: int = 0,
                    batch: Optional[int] = None, gain: float = 0.0,
                    planned: Optional[int] = None) -> Tuple[int, Optional[int], Optional[int]]:
    """(the batch's budget, the workers kept beside it, None before a worker is measured; the
    largest batch the workers' projection allows, where it stops growth but may not cut).

    In a pool the batch shares with its workers, the number of workers is decided first, once
    for the pool: the most of those the job asked for whose measured cost leaves the batch at
    least half of what the pool allows with no worker (a smaller batch costs a step little, as
    accumulation keeps the effective batch; a loader with no worker leaves the loop waiting on
    its data: batch first, the benchmark's loader that asked for 4 ended with 0). The batch then
    gets the rest. Decided after the batch, the count flipped 1, 0, 1 as the batch's peaks moved.
    For a loader that follows the plan, the count the last plan kept (``planned``) stays while it
    leaves the batch within ``gain`` (min_gain) of that half, and another must clear it by as
    much: the benchmark's MemdLoader, its batch beside 2 workers within a few samples of half,
    went 983 beside 1 -> 680 beside 2 -> 956 beside 1 twice in 440 s, each a rebuild whose fresh
    workers copied the dataset again.

    Until the workers show where they level off, each is projected up to the anonymous memory it
    maps, which may leave no batch at all: the benchmark's loop with four workers copying a
    300 MB dataset was told batch 1 beside four projected at 0.59 GiB (they level at 0.31), and
    at batch 1 they copied too slowly to ever show it. A projection is not evidence: it stops
    the batch from growing, and only what the workers hold and are about to add cuts it. Growth
    goes by the lowest room within the horizon (``dip``): on the highest read, as its rebuilt
    workers' pages were told apart, the benchmark's loop went to 164 where its room was 0.15 GiB
    lower a few seconds before and after."""
    per_worker = _per_worker(facts)
    wanted = _wanted(limits, facts)
    if not per_worker or not wanted:
        return budget, None, None
    queued, share = _queue(limits, facts)
    room = budget + facts.growth + sum(facts.uss) + queued  # with no worker: all of theirs comes back
    half = max(limits.min_batch, curve.max_batch(room) // 2)

    asked = limits.prefetch_factor or 2
    sample = _per_sample(limits, facts)

    def left(kept: int, each: int, b: int) -> int:
        # Each keeps prefetch_factor batches in flight (seed 004); one when memory cuts them, in a
        # loader that follows the plan (a loop's own keeps its own: the benchmark's four, costed at
        # one batch each beside the two memd would keep, queued eight), which carries two more:
        # one queued, one being built (_in_flight). At a batch larger than the one its level was
        # read at, a worker holds more samples as it builds one.
        batches = _in_flight(asked if kept == wanted or not facts.follows else 1, facts)
        if not sample:
            in_flight = batches * facts.batch_bytes if facts.batch_bytes else share * batches // asked
            return room - kept * (each + in_flight)
        # What a worker holds was read at the batch the job runs: past it, it holds more samples
        # as it builds a batch. (Counted from the batch its level was read at, four workers that
        # reached 320 MiB at 119 were costed 323 there, and the plan went 119 -> 102.)
        grown = sample * max(0, b - (batch or b))
        return int(room - kept * (each + grown + batches * sample * b))

    def beside_them(kept: int, each: int, less: int = 0) -> int:
        """The batch's budget beside ``kept`` workers of ``each``: their share at the largest
        batch that fits beside them (``less``: held back from it too)."""
        if not sample:
            return left(kept, each, 0) - less
        fits = largest(lambda b: curve.max_batch(left(kept, each, b) - less) >= b, near=batch or None)
        return left(kept, each, max(1, fits)) - less

    # Not the count read off its processes, which lags: their median within the horizon said 1
    # while it ran 3, and a fresh loader's count holds for no read or two. On it the benchmark's
    # MemdLoader went between 2 and 3 workers seven times in 18 s, each a rebuild whose fresh
    # workers started their copying over, before it had grown its batch once.
    running: Optional[int] = None
    if facts.follows:
        running = planned if planned is not None else _running(facts) if facts.count_held else None

    def enough(k: int) -> bool:
        bar = half if running is None else half * (1 - gain) if k <= running else half * (1 + gain)
        return curve.max_batch(beside_them(k, per_worker)) >= bar

    # A bisection, not a count down: the hint is the client's number, and 10**12 froze the daemon.
    kept = wanted if enough(wanted) else largest(lambda k: k < wanted and enough(k))
    # The batch goes beside the workers that live, if more than those kept: a loop with its own
    # DataLoader keeps the workers it built whatever the plan says (the benchmark's job that kept
    # its 4 was planned a batch beside 1 and killed). A loader that follows the plan shuts the
    # old ones down before the first batch of the new plan: beside those kept. (Planned beside
    # the 4 it was letting go, the benchmark's loader was told batch 1, and its 200 steps there
    # took 4 s, over before the daemon's next read of its processes.)
    beside = kept if facts.follows else max(kept, _running(facts))
    if not beside:
        return budget, 0, None
    projected = min(budget, beside_them(beside, per_worker))
    if facts.evident is None:
        return projected, kept, None
    # Growth goes beside the workers of the latest read too, if more: a loader's workers start
    # over a second, and in the first the median of the counts was 1 of 4 (a probe went 32 -> 130).
    starting = min(budget - dip, beside_them(max(beside, facts.newest or 0), per_worker, dip))
    return min(budget, beside_them(beside, facts.evident)), kept, curve.max_batch(starting)


def _workers(limits: Limits, facts: WorkerFacts, pool: Optional[Pool], level: str, host_total: Optional[int],
             host_available: Optional[int], cfg: PolicyConfig,
             kept: Optional[int] = None) -> Tuple[int, Optional[int], str]:
    """(num_workers, prefetch_factor, note). What the job asked for (a hint, Session(num_workers)),
    else the DataLoader's suggestion: as many as the CPUs it may use. Memory and pressure only cut
    from there, and the cut goes when they allow. ``kept``: the count decided with the batch in a
    pool they share (_beside_workers)."""
    wanted = _wanted(limits, facts)
    prefetch = limits.prefetch_factor or 2
    note = ""
    per_worker = _per_worker(facts)
    if kept is not None and per_worker is not None:  # a pool shared with the batch: decided with it (_beside_workers)
        if kept < wanted:
            # Say where the count came from: a job that asked for none was told "1 of the 2
            # workers asked for" beside the 4 its loop ran (2 was one per CPU).
            asked = "asked for" if limits.num_workers is not None else "for its CPUs"
            note = "%d of the %d workers %s, at %.2f GiB each, beside the batch; prefetch 1" % (
                kept, wanted, asked, (per_worker + _in_flight(1, facts) * (facts.batch_bytes or 0)) / GiB)
            wanted, prefetch = kept, 1
    elif per_worker:
        # Workers in host RAM beside a GPU's batch (or before the job's curve is known): the RAM
        # keeps its OS reserve and a margin.
        spare = host_free(host_total or 0, host_available or 0, cfg) - margin(host_total or 0, cfg)
        # Each worker costs what it reaches, and keeps prefetch_factor batches in flight (seed
        # 004); the workers' own memory now is in use already and comes back with a cut.
        per = per_worker + prefetch * (facts.batch_bytes or 0)
        affordable = max(0, int((spare + sum(facts.uss)) // per))
        if affordable < wanted:
            per = per_worker + (facts.batch_bytes or 0)  # memory cuts the workers: one batch in flight each
            affordable = max(0, int((spare + sum(facts.uss)) // per))
            fit = min(affordable, wanted)
            note = "%d worker%s of %.2f GiB each fit%s, not %d; prefetch 1" % (
                fit, "" if fit == 1 else "s", per / GiB, "s" if fit == 1 else "", wanted)
            wanted, prefetch = min(affordable, wanted), 1
    elif pool is not None and pool.kind == "unified" and host_total:
        table = next(n for floor, n in _UNIFIED_WORKER_TABLE if host_total >= floor)
        if table < wanted:
            note = "%d workers for %.0f GiB of unified memory, until workers are measured" % (table, host_total / GiB)
            wanted = table
    if rank(level) >= rank("high"):
        wanted = wanted // 2 if level == "high" else 0
        prefetch = 1
    return max(0, wanted), (prefetch if wanted > 0 else None), note

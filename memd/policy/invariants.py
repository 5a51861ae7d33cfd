"""The promises every plan keeps, checked last, whatever the moves before it decided.

The moves (controller.py) make a plan from the curve, the pool and the job's history; these
bound it, in one place, so that no move, however it reasons, can break them:

1. Its predicted peak fits its budget: the batch is at most the curve's largest batch under the
   budget (Curve.safe_batch: the curve's upper band, and past the largest batch measured where an
   overshoot kills, a convex curve through the largest measured steps), unless even the job's
   min_batch does not fit. The budget itself never passes its pool's bound (Pool.budget).
2. Where an overshoot is a kill (host RAM, unified memory, a cgroup), a batch above the largest
   the job has run is planned at most ``max_growth`` times that batch, whatever the curve says:
   past what was measured the curve is a guess (there, 1. holds it to a convex curve through the
   largest measured steps: fit.convex_past), and a step the daemon measured short would make the
   guess a dead job. Back to a batch it ran, a move may go at once.
3. One read cuts the batch by at most ``max_growth``, unless pressure is critical (the pool is
   nearly full: memory.planner's fuller_than_planned) or the cut is confirmed by the next read:
   a read whose budget contradicts the curve (a step's shared memory freed a moment after the
   trainer unmapped it) is held until another read shows it too. Meanwhile the plan keeps the
   budget of the read before, the one its batch fits.

4. Where an overshoot kills, the job's first spike_steps reports plan no more than leaves
   spike_reserve of its step's own memory free: a rarer step (an evaluation, one long batch in
   twenty) shows meanwhile and bounds the curve from then on. What is rarer, or peaks higher,
   cannot be seen coming (docs/policy.md).

An out-of-memory error needs no exception here: it cuts the control state (controller.after_oom)
before the decision, which then moves from the cut.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from memd.config import PolicyConfig
from memd.units import GiB

from .fit import Curve, largest


class Kept(NamedTuple):
    limit: int
    reason: str
    budget: Optional[int]  # the budget the plan keeps (the read before's, while a cut waits)
    # A cut past max_growth that one read asked for, waiting for the next: (its budget, the read,
    # the batch before it)
    pending: Optional[Tuple[int, float, int]]
    evidence: Optional[int] = None  # the plan's batch is predicted at its own latest step's peak


def keep_promises(limit: int, reason: str, current: Optional[int], curve: Optional[Curve], budget: Optional[int],
                  min_batch: int, level: str, cfg: PolicyConfig, kills: bool,
                  read: Optional[float] = None, pending: Optional[Tuple[int, float, int]] = None,
                  evidence: Optional[int] = None, before: Optional[int] = None,
                  steps: Optional[int] = None, base: Optional[int] = None) -> Kept:
    """``limit`` (the moves' batch, before the job's min/max and the effective-batch split) bounded
    by the promises above, with its reason and the budget it keeps. ``read``: the sample the
    decision is made on (None: each call is a read of its own); ``pending``: a deep cut the read
    before asked for (Kept.pending); ``before``: the budget of the plan before (ControlState.budget),
    which a cut that waits keeps; ``evidence``: the peak of the latest step at ``limit``, the
    job's current batch, where a move keeps it on that step's word (a batch beside workers whose
    steps fit, within the budget of its workers' latest reads and the margin's spare part:
    controller.decide). That step is the batch's prediction, and the budget is at least it.
    ``steps``: the reports the job made this run (None: not counted, no spike reserve); ``base``:
    what its trainer held before its first step, a floor for the step's fixed memory where the
    curve knows none (one batch size)."""
    if evidence is not None and current is not None and limit == current and budget is not None:
        return Kept(limit, reason, max(budget, evidence), None, evidence)
    if curve is not None and budget is not None:
        fits = max(curve.safe_batch(budget), min_batch)
        if limit > fits:
            limit, reason = fits, "%d fits: predicted peak %.2f GiB of a %.2f GiB budget%s" % (
                fits, curve.upper(fits) / GiB, budget / GiB, "" if curve.max_batch(budget) <= fits else
                ", its peak past the largest batch it has run taken to grow as a convex curve through its largest "
                "steps")
    if kills and curve is not None and budget is not None and steps is not None and steps < cfg.spike_steps:
        spared = reserved_batch(curve, budget, cfg.spike_reserve, base or 0)
        if limit > max(spared, current or 0, min_batch):
            limit, reason = max(spared, current or 0, min_batch), "%d: for its first %d steps a job leaves %.0f %% " \
                "of its step's own memory unplanned, in case a rarer step peaks higher (%d so far; %d would fit)" % (
                    max(spared, current or 0, min_batch), cfg.spike_steps, 100 * cfg.spike_reserve, steps, limit)
    if kills and curve is not None and curve.observed:
        ran = max(b for b, _ in curve.observed)
        top = max(ran + 1, int(ran * cfg.max_growth))
        if limit > top:
            limit, reason = top, "%d: at most %gx %d, the largest batch it has run, where running out of memory " \
                "is a kill (%d would fit its %.2f GiB budget)" % (top, cfg.max_growth, ran, limit, (budget or 0) / GiB)
    same_read = pending is not None and read is not None and pending[1] == read
    start = pending[2] if pending is not None and same_read else current  # the plan before this read
    if start is None:
        return Kept(limit, reason, budget, None)
    floor = max(1, int(start / cfg.max_growth))
    if (limit < floor and level != "critical" and budget is not None and before is not None and curve is not None
            and before > budget and curve.upper(floor) <= before and (pending is None or same_read)):
        # This read's budget contradicts the one the plan before was made on: that one stands, for
        # the half it allows, until the next read says the same.
        return Kept(floor, "%d: half of %d, the most one read cuts: its %.2f GiB budget would allow %d, and the "
                    "next read confirms it or not" % (floor, start, budget / GiB, limit), before,
                    (budget, -1.0 if read is None else read, start))
    return Kept(limit, reason, budget, None)


def reserved_batch(curve: Curve, budget: int, reserve: float, base: int = 0) -> int:
    """The largest batch whose predicted peak, its part above the curve's fixed memory (or
    ``base``, if more) raised by ``reserve``, fits ``budget`` (0 when none does). From one batch
    size the curve counts all of a step as per sample: held back by half of all of it, a job
    stayed at its default for its first 24 steps."""
    fixed = max(curve.fixed_bytes, base)
    return largest(lambda b: curve.upper(b) + reserve * max(0.0, curve.upper(b) - fixed) <= budget,
                   near=curve.safe_batch(budget) or None)

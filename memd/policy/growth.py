"""Where a dataloader worker's own memory is headed.

A worker forked from the trainer shares the trainer's pages until it writes to them; reading a
Python-object dataset writes reference counts, so every record it reads becomes its own copy
(seed 004). Its growth slows as fewer records are new to it and stops at a copy of the dataset.
A worker is taken to have levelled off only when it did work (CPU seconds) and grew little
for it, so a paused worker (a throttled loader, an evaluation pass) is not mistaken for one
that has finished copying. Its growth is measured against the CPU seconds it used, not the
clock: what it copies follows what it reads, and a worker waiting on a full queue reads nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

# Levelled: over the reads kept it used at least WORK CPU seconds (an idle worker waiting on its
# queue uses next to none) and its rate would add at most LEVEL of what it holds within the
# horizon. Measured, the workers shape at batch 64, four workers read every 2 s: USS 42-57 ->
# 228 MiB in the first 68 s (2-7 MiB a second), 303 MiB at 178 s, then 306-315 MiB for the 360 s
# that followed, each worker using 0.3-0.4 CPU seconds per 16 s all along.
WORK, LEVEL = 0.1, 0.02
# And over its last LEVEL_WORK CPU seconds it grew at most LEVEL_SLOPE of what it holds per CPU
# second: the clock alone took those four for levelled at 298-307 MiB (95-98 % of their level),
# and on a loaded machine, where a worker starved of CPU copies little for a while, the
# benchmark's loop took a worker for levelled some 20 MiB short, which four times over let its
# batch past what fits (191 where 138 fits). Against CPU seconds they were at 313 MiB (99.7 %).
LEVEL_SLOPE, LEVEL_WORK = 0.005, 1.0
# Its level is read off its course once the second half of its CPU time grew it at most SLOWED of
# what the first half did, and the first half grew it at least GREW of what it holds (less is a
# read's noise, not a course); before that a straight line and the start of a curve look alike.
# Not a fifth: a worker is read at the job's steps, and a loop's first step at a new batch of 649
# took 4 s; its rebuilt workers were first read at 276 and 215 MiB, and the first one's course,
# 34 MiB then 16 in the halves of its CPU time (a tenth of what it held), told no level. Past the
# job's level it was taken at its rate, 35 MiB within 10 s, where it added some 12, and the
# batch was cut to 579. Its course says 340; the run's workers levelled at 336-343.
SLOWED, GREW = 0.5, 0.05
# How far below where its workers level off a level read off a course may lie: on the recorded
# traces (tests/data/worker_growth.json) level_of read -0.3 % to +4.7 % of the level with 80-95 %
# of it copied, but in the benchmark's loops, whose rebuilt workers were first read late in their
# copying, it read 288-324 MiB where they level at 313-315 (-8 % to +3 %). Growth beside workers
# goes by the level this much higher until one of them levels off (planner.worker_facts).
COURSE_ERROR = 0.08
COURSE = 32  # points of a worker's course kept (thinned to every other one when full)
# A rate read over less than RATE_SPAN seconds is a fresh fork's first burst, not its course: the
# benchmark's four workers at batch 32 went from 2 to 34 MiB in their first 0.2 s (prefetching
# their first batches), 16 MiB a second each, then copied at 2-5 MiB a second; extrapolated over
# 10 s that burst cut the job from 32 to 1 within 2 s, where its workers never showed their level.
RATE_SPAN = 5.0


@dataclass(frozen=True)
class Growth:
    projected: int  # what it will hold within the horizon at the rate it grew, at most its bound
    levelled: bool  # it did work and grew little for it: what it holds is what it costs
    rate: float  # bytes per second over the reads kept
    level: Optional[int] = None  # where its copying is headed, once it slowed enough to tell (level_of)
    sustained: bool = False  # its rate was read over at least RATE_SPAN seconds


def growth(reads: Sequence[Tuple[float, Optional[float], int]], bound: int, horizon: float,
           course: Sequence[Tuple[float, int]] = ()) -> Growth:
    """One worker's course from ``reads``, (clock seconds, CPU seconds or None, bytes it alone
    holds), oldest first. ``bound``: the most it can come to own (its anonymous pages).
    ``course``: (CPU seconds, bytes it holds) since it was first read (kept by keep())."""
    (t0, c0, first), (t1, c1, last) = reads[0], reads[-1]
    rate = (last - first) / (t1 - t0) if t1 > t0 and last > first else 0.0
    projected = int(min(last + rate * horizon, max(bound, last)))
    worked = c0 is not None and c1 is not None and c1 - c0 >= WORK
    levelled = len(reads) >= 3 and worked and rate * horizon <= LEVEL * last and (not course or _flat(course))
    level = last if levelled else level_of(course, bound)
    return Growth(projected if level is None else max(level, last), levelled, rate, level, t1 - t0 >= RATE_SPAN)


def level_of(course: Sequence[Tuple[float, int]], bound: int) -> Optional[int]:
    """Where a worker's memory levels off, from its course over CPU seconds; None until its growth
    has slowed enough to tell. Copying a dataset it reads at random (with or without replacement
    across epochs), a worker's growth per CPU second falls in step with what it has left to copy,
    so its course is geometric: halves of its CPU time that grew it by a and then b < a head to
    b * (b / a) / (1 - b / a) more (Aitken's extrapolation). Measured (tests/data/worker_growth.json):
    four workers at batch 64 that level at 313 MiB read 337 when at 270 and 324 at 293; one at
    batch 600, 340 MiB, read 366 at 327 and 340 at 335. A worker that copies at a steady rate and
    stops has no level until it stops: its projection holds meanwhile."""
    if len(course) < 5:
        return None
    (c0, u0), (c2, u2) = course[0], course[-1]
    if c2 - c0 < WORK:
        return None
    u1 = _at(course, (c0 + c2) / 2)
    a, b = u1 - u0, max(0.0, u2 - u1)
    if a < GREW * u2 or b > SLOWED * a:
        return None
    ratio = b / a
    return int(min(max(bound, u2), u2 + b * ratio / (1 - ratio)))


def _flat(course: Sequence[Tuple[float, int]]) -> bool:
    """Whether over its last LEVEL_WORK CPU seconds the worker grew at most LEVEL_SLOPE of what
    it holds per CPU second (False until it worked that much)."""
    c1, u1 = course[-1]
    for c0, u0 in reversed(course[:-1]):
        if c1 - c0 >= LEVEL_WORK:
            return (u1 - u0) / (c1 - c0) <= LEVEL_SLOPE * u1
    return False


def keep(course: List[Tuple[float, int]], cpu: float, held: int) -> None:
    """Add a point to a worker's course, bounded: when full, every other point goes (the first and
    the span stay), so a worker followed for hours costs the same as one followed for seconds."""
    if course and cpu <= course[-1][0]:
        return  # no work since the last point: nothing new about its course
    course.append((cpu, held))
    if len(course) > COURSE:
        course[:] = course[:-1:2] + course[-1:]


def _at(course: Sequence[Tuple[float, int]], cpu: float) -> float:
    """What the worker held after ``cpu`` CPU seconds, between the points either side."""
    for (ca, ua), (cb, ub) in zip(course, course[1:]):
        if ca <= cpu <= cb:
            return ua + (ub - ua) * (cpu - ca) / (cb - ca) if cb > ca else ub
    return course[-1][1]

"""Where a dataloader worker's own memory is headed.

A worker forked from the trainer shares the trainer's pages until it writes to them; reading a
Python-object dataset writes reference counts, so every record it reads becomes its own copy
(seed 004). Its growth slows as fewer records are new to it and stops at a copy of the dataset.
A worker is taken to have levelled off only when it did work (CPU seconds) and grew little
for it, so a paused worker (a throttled loader, an evaluation pass) is not mistaken for one
that has finished copying.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

# Levelled: over the reads kept it used at least WORK CPU seconds (an idle worker waiting on its
# queue uses next to none) and its rate would add at most LEVEL of what it holds within the
# horizon. Measured, the workers shape at batch 64, four workers read every 2 s: USS 42-57 ->
# 228 MiB in the first 68 s (2-7 MiB a second), 303 MiB at 178 s, then 306-315 MiB for the 360 s
# that followed, each worker using 0.3-0.4 CPU seconds per 16 s all along.
WORK, LEVEL = 0.1, 0.02


@dataclass(frozen=True)
class Growth:
    projected: int  # what it will hold within the horizon at the rate it grew, at most its bound
    levelled: bool  # it did work and grew little for it: what it holds is what it costs
    rate: float  # bytes per second over the reads kept


def growth(reads: Sequence[Tuple[float, Optional[float], int]], bound: int, horizon: float) -> Growth:
    """One worker's course from ``reads``, (clock seconds, CPU seconds or None, bytes it alone
    holds), oldest first. ``bound``: the most it can come to own (its anonymous pages)."""
    (t0, c0, first), (t1, c1, last) = reads[0], reads[-1]
    rate = (last - first) / (t1 - t0) if t1 > t0 and last > first else 0.0
    projected = int(min(last + rate * horizon, max(bound, last)))
    worked = c0 is not None and c1 is not None and c1 - c0 >= WORK
    return Growth(projected, len(reads) >= 3 and worked and rate * horizon <= LEVEL * last, rate)

"""Memory pressure levels, ok < elevated < high < critical, with hysteresis.

A level rises as soon as its threshold is crossed and falls only after the signals have stayed
below 80 % of the current level's thresholds for ``calm_seconds``, so plans do not flap at a
boundary. Thresholds (PolicyConfig) start from the anchors in docs/policy.md: PSI some avg10
>= 10 % is elevated, full avg10 >= 10 % or less than 2 % of the pool available is critical.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from memd.client.plan import PRESSURE_LEVELS
from memd.config import PolicyConfig
from memd.policy.budget import bounded_by, container_cgroup
from memd.sampling.snapshot import Cgroup, Snapshot
from memd.units import MiB

EXIT_SCALE = 0.8
APPLE_WARN, APPLE_CRITICAL = 2, 4


@dataclass(frozen=True)
class Signals:
    some_avg10: Optional[float]  # PSI ratios; None without PSI
    full_avg10: Optional[float]
    available_ratio: float  # available / capacity of the pool
    apple_level: Optional[int] = None


@dataclass(frozen=True)
class PressureState:
    level: str = "ok"
    since: float = 0.0  # monotonic time the level was entered
    calm_since: Optional[float] = None  # when the signals first fell below the exit thresholds


def host_signals(snapshot: Snapshot) -> Signals:
    """The host pool's signals; a container's cgroup (see budget.container_cgroup) narrows them."""
    cg = container_cgroup(snapshot)
    total, available = bounded_by(cg, snapshot.system.total_bytes, snapshot.system.available_bytes)
    psi = snapshot.pressure
    if cg is not None and cg.pressure is not None:
        psi = cg.pressure  # the cgroup's own stalls are the ones this job will feel
    return Signals(
        some_avg10=psi.some_avg10 if psi else None,
        full_avg10=psi.full_avg10 if psi else None,
        available_ratio=available / total if total else 1.0,
        apple_level=snapshot.apple_pressure_level,
    )


# A group with no PSI (cgroup v1) thrashes when, full, it keeps reading back the file pages the
# kernel just evicted from it (the job's code, its mapped data) and its processes wait on them as
# major faults. In 2 GiB groups the benchmark's four-workers job read back 239,451 to 2,357,982
# pages with 858 to 2,312 major faults in its worst 10 s once it thrashed (four fixed runs, at
# 123 to 135); from 30 s in to 15 s before its end, every run memd planned and every fixed run
# that ran well read back at most 1,480 pages with at most 1 major fault in any 10 s; starting
# up, its group not yet full (867-1,576 MiB used), up to 51,984 pages and 95 faults. Counted as
# PSI's full stall: the group's tasks wait on the disk.
THRASH_SECONDS = 10.0
THRASH_REFAULT_BYTES = 64 * MiB
THRASH_MAJOR_FAULTS = 256
THRASH_FULL = 0.9  # of its limit: a group that is not full is not made to evict


def thrashing(reads: Sequence[Tuple[float, Optional[int], Optional[int], Optional[int], Optional[int]]]) -> bool:
    """Whether a group thrashes now, from its reads oldest first: (monotonic time, bytes read
    back, major faults, usage, limit). Counters that went back (a new group) tell nothing."""
    if len(reads) < 2:
        return False
    now, refaults, faults, usage, limit = reads[-1]
    if refaults is None or faults is None or usage is None or not limit or usage < THRASH_FULL * limit:
        return False
    start = reads[0]  # the latest read THRASH_SECONDS or more before, else the oldest
    for read in reads:
        if read[0] > now - THRASH_SECONDS:
            break
        start = read
    _, refaults0, faults0, _, _ = start
    if refaults0 is None or faults0 is None:
        return False
    return refaults - refaults0 >= THRASH_REFAULT_BYTES and faults - faults0 >= THRASH_MAJOR_FAULTS


def group_signals(cg: Cgroup, thrash: bool) -> Optional[Signals]:
    """A job's own cgroup's signals: its PSI (v2), else whether it thrashes (``thrashing``); None
    when neither can be read. How full it is counts in its budget (planner.fuller_than_planned)."""
    if cg.pressure is not None:
        return Signals(cg.pressure.some_avg10, cg.pressure.full_avg10, 1.0)
    if cg.refault_bytes is None or cg.major_faults is None:
        return None
    return Signals(None, 1.0 if thrash else 0.0, 1.0)


def raw_level(signals: Signals, cfg: PolicyConfig, scale: float = 1.0) -> str:
    some = signals.some_avg10 or 0.0
    full = signals.full_avg10 or 0.0
    if (full >= cfg.critical_full_avg10 * scale or signals.available_ratio < cfg.critical_available_ratio / scale
            or signals.apple_level == APPLE_CRITICAL):
        return "critical"
    if some >= cfg.high_some_avg10 * scale or signals.apple_level == APPLE_WARN:
        return "high"
    if some >= cfg.elevated_some_avg10 * scale:
        return "elevated"
    return "ok"


def next_state(prev: PressureState, signals: Signals, now: float, cfg: PolicyConfig) -> PressureState:
    current = rank(prev.level)
    entered = raw_level(signals, cfg)
    if rank(entered) > current:
        return PressureState(entered, now, None)
    if rank(raw_level(signals, cfg, EXIT_SCALE)) >= current:
        return PressureState(prev.level, prev.since, None)  # not calm yet
    calm_since = prev.calm_since if prev.calm_since is not None else now
    if now - calm_since >= cfg.calm_seconds:
        return PressureState(entered, now, None)
    return PressureState(prev.level, prev.since, calm_since)


def rank(level: str) -> int:
    return PRESSURE_LEVELS.index(level)

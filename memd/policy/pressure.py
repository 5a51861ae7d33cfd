"""Memory pressure levels, ok < elevated < high < critical, with hysteresis.

A level rises as soon as its threshold is crossed and falls only after the signals have stayed
below 80 % of the current level's thresholds for ``calm_seconds``, so plans do not flap at a
boundary. Thresholds (PolicyConfig) start from the anchors in docs/policy.md: PSI some avg10
>= 10 % is elevated, full avg10 >= 10 % or less than 2 % of the pool available is critical.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from memd.client.plan import PRESSURE_LEVELS
from memd.config import PolicyConfig
from memd.policy.budget import bounded_by, container_cgroup
from memd.sampling.snapshot import Snapshot

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

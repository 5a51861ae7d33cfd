"""The Plan a training loop follows, and the arithmetic both ends share.

``split_batch`` is the one place the effective-batch rule lives: the daemon's controller and
the client's local fallback both call it, so a plan keeps the effective batch whoever made it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

from .counts import at_least, whole

PRESSURE_LEVELS = ("ok", "elevated", "high", "critical")
SOURCES = ("daemon", "fallback")
#: Candidates split_batch tries at most (a few milliseconds): enough to search every target below
#: 2**32 completely (the protocol's limit is 2**31 - 1); a larger one is searched this far and no
#: further, so no number a caller passes can keep the daemon or a training loop busy.
DIVISOR_CHECKS = 1 << 17
#: Seconds a plan is served from the client's cache at most, whatever the daemon said (it says 1).
MAX_FRESH = 10.0


@dataclass(frozen=True)
class Plan:
    batch_size: int
    grad_accum_steps: int
    effective_batch_size: int
    num_workers: int
    prefetch_factor: Optional[int]  # None whenever num_workers == 0, as DataLoader requires
    throttle: bool  # pause data loading now: the machine is close to running out
    pressure: str  # one of PRESSURE_LEVELS
    reason: str
    source: str  # "daemon", or "fallback" when built locally because the daemon did not answer
    fresh_for: float = 1.0  # seconds the plan may be served from cache without asking again

    def to_wire(self) -> Dict[str, Any]:
        return dict(vars(self))  # flat fields: asdict()'s recursive deep copy costs ~40 us per plan

    @classmethod
    def from_wire(cls, data: Any, source: str = "daemon") -> "Plan":
        """Validate a plan from the wire; raises ValueError on anything malformed."""
        if not isinstance(data, dict):
            raise ValueError("plan is not a map")
        ints = {}
        for name in ("batch_size", "grad_accum_steps", "effective_batch_size", "num_workers"):
            value = data.get(name)
            if not whole(value) or value < (0 if name == "num_workers" else 1):
                raise ValueError("plan.%s is not a valid count: %r" % (name, value))
            ints[name] = value
        prefetch = data.get("prefetch_factor")
        if prefetch is not None and (not whole(prefetch) or prefetch < 1):
            raise ValueError("plan.prefetch_factor is not a positive int: %r" % (prefetch,))
        if ints["num_workers"] == 0:
            prefetch = None
        pressure = data.get("pressure")
        if pressure not in PRESSURE_LEVELS:
            raise ValueError("plan.pressure is not a level: %r" % (pressure,))
        fresh_for = data.get("fresh_for", 1.0)
        if not isinstance(fresh_for, (int, float)) or isinstance(fresh_for, bool) or not 0 <= fresh_for <= 3600:
            raise ValueError("plan.fresh_for is out of range: %r" % (fresh_for,))
        return cls(
            prefetch_factor=prefetch,
            throttle=bool(data.get("throttle", False)),
            pressure=pressure,
            reason=str(data.get("reason", ""))[:500],
            source=source,
            fresh_for=float(fresh_for),
            **ints,
        )


def make_plan(batch: int, steps: int, num_workers: int, prefetch_factor: Optional[int], *, reason: str,
              source: str, pressure: str = "ok", throttle: bool = False, fresh_for: float = 1.0) -> Plan:
    """A plan of ``batch`` x ``steps`` (split_batch's) and its workers: the one place, on either
    end, its derived fields are set (the effective batch; no prefetch factor without workers)."""
    return Plan(
        batch_size=batch,
        grad_accum_steps=steps,
        effective_batch_size=batch * steps,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        throttle=throttle,
        pressure=pressure,
        reason=reason,
        source=source,
        fresh_for=fresh_for,
    )


def split_batch(limit: int, target: Optional[int], min_batch: int = 1) -> Tuple[int, int, str]:
    """Pick (batch_size, grad_accum_steps, note) for a largest usable batch ``limit``.

    With a target effective batch, the batch size is the largest divisor of the target that is
    at most ``limit`` and at least ``min_batch``, so batch x steps == target exactly (target 16,
    limit 14 -> 8 x 2). Only when no divisor fits is the effective batch allowed to differ, and
    the note then says so. Without a target the batch is ``limit`` and there is no accumulation.
    """
    limit = max(limit, min_batch, 1)
    if not target:
        return limit, 1, ""
    if target < min_batch:
        return min_batch, 1, "target %d is below min_batch %d: effective batch is %d" % (target, min_batch, min_batch)
    if limit >= target:
        return target, 1, ""
    divisor, complete = _largest_divisor(target, min_batch, limit)
    if divisor is not None:
        return divisor, target // divisor, ""
    steps = max(1, round(target / limit))
    if not complete:
        return limit, steps, "no divisor of target %d between %d and %d found in %d tries: effective batch is %d" % (
            target, min_batch, limit, DIVISOR_CHECKS, limit * steps)
    return limit, steps, "no divisor of target %d fits between %d and %d: effective batch is %d" % (
        target, min_batch, limit, limit * steps)


def within_limits(plan: Plan, min_batch: int, max_batch: Optional[int], target_effective_batch: Optional[int],
                  max_workers: int) -> Plan:
    """A plan kept to the job's own limits. memd's daemon keeps them already; the client checks
    anyway, because whoever answers on the socket steers the job's memory: a stranger listening
    where the daemon should be handed a job with ``max_batch=64`` batch 100000, 64 workers and a
    plan fresh for an hour. ``max_workers``: what the job asked for, else the CPUs it may use."""
    changes: Dict[str, Any] = {}
    kept = []
    batch = plan.batch_size
    if batch < min_batch or (max_batch is not None and batch > max_batch):
        limit = max(min_batch, batch if max_batch is None else min(batch, max_batch))
        batch, steps, _ = split_batch(limit, target_effective_batch, min_batch)
        changes.update(batch_size=batch, grad_accum_steps=steps, effective_batch_size=batch * steps)
        kept.append("batch %d" % plan.batch_size)
    if plan.num_workers > max_workers:
        changes.update(num_workers=max_workers, prefetch_factor=plan.prefetch_factor if max_workers else None)
        kept.append("%d workers" % plan.num_workers)
    if plan.fresh_for > MAX_FRESH:
        changes["fresh_for"] = MAX_FRESH
    if kept:
        changes["reason"] = "%s; the daemon's %s kept to this job's limits" % (plan.reason, " and ".join(kept))
    return replace(plan, **changes) if changes else plan


def fallback_plan(
    min_batch: int = 1,
    max_batch: Optional[int] = None,
    default_batch: Optional[int] = None,
    target_effective_batch: Optional[int] = None,
    hints: Optional[Dict[str, Any]] = None,
    reason: str = "daemon unavailable",
    base: Optional[Plan] = None,
    cpus: Optional[int] = None,
) -> Plan:
    """A plan made without the daemon, from the caller's own defaults (or the last known plan):
    the workers it asked for, else as many as the CPUs it may use (the DataLoader's suggestion)."""
    hints = hints or {}
    if base is not None:
        limit = base.batch_size
        workers = base.num_workers
        prefetch = base.prefetch_factor
    else:
        limit = default_batch or target_effective_batch or min_batch
        workers = _hint_int(hints, "num_workers", max(1, cpus) if cpus else 0)
        prefetch = _hint_int(hints, "prefetch_factor", 2)
    if max_batch:
        limit = min(limit, max_batch)
    batch, steps, note = split_batch(limit, target_effective_batch, min_batch)
    return make_plan(batch, steps, workers, prefetch, reason=reason + ("; " + note if note else ""), source="fallback",
                     pressure=base.pressure if base is not None else "ok")


@functools.lru_cache(maxsize=1024)
def _largest_divisor(n: int, low: int, high: int) -> Tuple[Optional[int], bool]:
    """(the largest divisor of ``n`` in [low, high] or None, whether the search was complete).

    Divisors pair up around sqrt(n): those above it are n // e for small e, found largest first
    by counting e up from n / high; those below are counted down from min(high, sqrt(n)). The
    first hit on either side is the answer, and at most DIVISOR_CHECKS candidates are tried:
    listing every divisor first made a target of 2**62 cost 2 x 10^9 steps. Cached, because a
    session's target stays while its limit moves among a few values.
    """
    root = math.isqrt(n)
    tries = DIVISOR_CHECKS
    for e in range(max(1, -(-n // high)), min(root, n // low) + 1):  # divisors n // e >= sqrt(n)
        if n % e == 0:
            return n // e, True
        tries -= 1
        if not tries:
            return None, False
    for d in range(min(high, root), low - 1, -1):  # divisors d <= sqrt(n)
        if n % d == 0:
            return d, True
        tries -= 1
        if not tries:
            return None, False
    return None, True


def _hint_int(hints: Dict[str, Any], name: str, default: int) -> int:
    value = at_least(hints.get(name), 0)
    return default if value is None else value

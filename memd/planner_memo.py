"""What the planner keeps between one session's decisions: its own scratch, not the session's
state. Only memd.planner reads or writes it; the session record holds one
(SessionRecord.planner) so that it lives and ends with the session."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

from memd.policy.pressure import PressureState


@dataclass
class PlannerMemo:
    # The workers' course (planner.worker_facts): each live one's latest job reads (time, CPU
    # seconds, USS) and projection; the most one reached this run; what the workers of a rebuilt
    # loader were on their way to, until a live one levels off; one worker's cost from these.
    worker_reads: Dict[int, Deque[Tuple[float, Optional[float], int]]] = field(default_factory=dict)
    worker_courses: Dict[int, List[Tuple[float, int]]] = field(default_factory=dict)  # (CPU s, USS), growth.keep
    # Each live one's latest three USS as read, where worker_reads keeps a following loader's at rest
    worker_raw: Dict[int, Deque[int]] = field(default_factory=dict)
    worker_projected: Dict[int, int] = field(default_factory=dict)
    worker_projected_last: Optional[int] = None  # the most any worker was projected to at the read before
    worker_inherited: int = 0
    worker_cost: int = 0
    worker_growth: int = 0  # what the live workers are projected to add
    worker_copying: int = 0  # the same, with a fresh fork's first burst
    # Where this job's workers level off: (levelled, CPU seconds, bytes), a worker that levelled
    # before one read off a course (growth.level_of), and the one that had done the most work;
    # None until one has slowed enough to tell.
    worker_level: Optional[Tuple[bool, float, int]] = None
    worker_evident: int = 0  # one worker's cost from evidence alone, until a worker levelled off
    workers_read: Optional[float] = None  # the job read they were last updated from
    worker_counts: Deque[Tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=64))
    # (job read's monotonic time, shared memory its group holds that none of its processes maps,
    # the batch the job ran): the batches on their way from its workers (controller._queue)
    queued: Deque[Tuple[float, int, int]] = field(default_factory=lambda: collections.deque(maxlen=64))
    # (job read's monotonic time, capacity, free + what the trainer holds, the workers' own memory)
    # of a host pool's reads: the last two for planner.steadied, those within the horizon for
    # planner.room_dip
    rooms: Deque[Tuple[float, int, int, int]] = field(default_factory=lambda: collections.deque(maxlen=32))
    mapped_file: Optional[int] = None  # the most file pages the job's group kept mapped (planner.mapped_kept)
    # (when read, what the pool held outside its sessions then) within others_horizon_seconds:
    # how fast that grows (planner.growth_ahead)
    outside: Deque[Tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=256))
    # The pressure in the job's own cgroup (planner.group_level): its reads (time, bytes read
    # back, major faults, usage, limit) within pressure.THRASH_SECONDS and more, and its level.
    group_reads: Deque[Tuple[float, Optional[int], Optional[int], Optional[int], Optional[int]]] = field(
        default_factory=lambda: collections.deque(maxlen=128))
    group_read: Optional[float] = None
    group_pressure: PressureState = field(default_factory=PressureState)

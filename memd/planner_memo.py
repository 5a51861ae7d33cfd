"""What the planner keeps between one session's decisions: its own scratch, not the session's
state. Only memd.planner reads or writes it; the session record holds one
(SessionRecord.planner) so that it lives and ends with the session."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Deque, Dict, Optional, Tuple


@dataclass
class PlannerMemo:
    # The workers' course (planner.worker_facts): each live one's latest job reads (time, CPU
    # seconds, USS) and projection; the most one reached this run; what the workers of a rebuilt
    # loader were on their way to, until a live one levels off; one worker's cost from these.
    worker_reads: Dict[int, Deque[Tuple[float, Optional[float], int]]] = field(default_factory=dict)
    worker_projected: Dict[int, int] = field(default_factory=dict)
    worker_reached: int = 0
    worker_inherited: int = 0
    worker_cost: int = 0
    worker_growth: int = 0  # what the live workers are projected to add
    workers_read: Optional[float] = None  # the job read they were last updated from
    # (job read's monotonic time, capacity, free + held) of the last two reads of a host pool
    # (planner.steadied)
    rooms: Deque[Tuple[float, int, int]] = field(default_factory=lambda: collections.deque(maxlen=2))

"""The daemon's shared state: what the sampler last saw and what the server knows of jobs.

The sampler thread publishes ``snapshot``, ``pressure`` and ``jobs`` by replacing whole values
(one reference assignment each, atomic under the GIL); the server thread owns ``sessions`` and
``store``; the metrics collector only reads. No value is ever mutated in place once published.
"""
from __future__ import annotations

import bisect
import collections
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Counter, Dict, Optional, Tuple

from memd.config import Config
from memd.logs import Budget, Throttle
from memd.policy.pressure import PressureState
from memd.sampling.snapshot import JobMemory, Snapshot
from memd.sessions import Sessions
from memd.state import StateStore

VERSION = "0.1.0"


@dataclass
class Core:
    config: Config
    sessions: Sessions
    store: StateStore
    clock: Callable[[], float] = time.monotonic
    proc_root: str = "/proc"
    host: str = field(default_factory=socket.gethostname)
    started: float = field(default_factory=time.time)
    snapshot: Optional[Snapshot] = None
    pressure: PressureState = field(default_factory=PressureState)
    jobs: Dict[int, JobMemory] = field(default_factory=dict)
    sampler_heartbeat: float = 0.0  # monotonic time of the sampler's last completed pass
    sample_errors: Counter = field(default_factory=collections.Counter)  # by source
    requests: Counter = field(default_factory=collections.Counter)  # (op, outcome) -> count
    latency: "Histogram" = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    sessions_expired: int = 0
    epoch: int = 0  # bumped by the server thread whenever a session changes (see memd.ops.memo.decide)
    ooms_reported: int = 0
    kills_learned: int = 0  # sessions whose process the OOM killer ended (ops.lifecycle.learn_kill)
    log_throttle: Throttle = field(default_factory=Throttle)  # what a client's request may make the daemon log
    session_log: Budget = field(default_factory=Budget)  # session_opened / session_closed lines
    oom_log: Budget = field(default_factory=Budget)  # oom_reported lines (apart: a flood of sessions hides none)
    plan_log: Budget = field(default_factory=Budget)  # batch_changed lines

    def uptime(self) -> float:
        return time.time() - self.started

    def observe_request(self, op: str, outcome: str, seconds: float) -> None:
        self.requests[(op, outcome)] += 1
        self.latency.observe(seconds)


# Seconds; request handling is tens of microseconds, so the buckets start low.
LATENCY_BUCKETS: Tuple[float, ...] = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25)


class Histogram:
    """Cumulative-bucket counts, exported as-is by the metrics collector."""

    def __init__(self, bounds: Tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)  # the first bound the value is within (every request's)
        if i < len(self.counts):
            self.counts[i] += 1
        self.count += 1
        self.sum += value

    def cumulative(self):
        running, out = 0, []
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append((bound, running))
        return out

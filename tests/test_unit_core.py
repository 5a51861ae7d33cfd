"""The daemon's shared state (memd/core.py) on its own: the request counters and the latency
histogram the metrics collector exports as they are."""
from memd.config import Config
from memd.core import LATENCY_BUCKETS, Core, Histogram
from memd.sessions import Sessions
from memd.state import StateStore


def test_a_histogram_counts_each_value_once_in_its_first_bucket_and_cumulates_on_export():
    h = Histogram((0.1, 1.0, 10.0))
    for value in (0.05, 0.1, 0.5, 10.0, 99.0):  # a bound is inclusive; beyond the last only +Inf has it
        h.observe(value)
    assert h.counts == [2, 1, 1] and h.count == 5 and h.sum == 109.65
    assert h.cumulative() == [(0.1, 2), (1.0, 3), (10.0, 4)]


def test_requests_are_counted_by_op_and_outcome_and_timed(tmp_path):
    core = Core(Config(), Sessions(4, 60.0, lambda: 0.0, lambda s: True), StateStore(str(tmp_path)))
    core.observe_request("plan", "ok", 0.00004)
    core.observe_request("plan", "ok", 0.002)
    core.observe_request("hello", "invalid", 0.3)
    assert dict(core.requests) == {("plan", "ok"): 2, ("hello", "invalid"): 1}
    assert core.latency.bounds == LATENCY_BUCKETS and core.latency.count == 3
    assert core.latency.cumulative()[0] == (0.00005, 1) and core.latency.cumulative()[-1] == (0.25, 2)


def test_each_core_has_its_own_counters(tmp_path):
    """Mutable defaults made per instance: two daemons in one process (the tests') share nothing."""
    one, two = (Core(Config(), Sessions(4, 60.0, lambda: 0.0, lambda s: True), StateStore(str(tmp_path)))
                for _ in range(2))
    one.observe_request("ping", "ok", 0.001)
    one.sample_errors["nvml"] += 1
    assert not two.requests and not two.sample_errors and two.latency.count == 0
    assert one.uptime() >= 0 and one.epoch == 0

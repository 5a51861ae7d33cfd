"""A job that gives memd nothing (no default_batch, no target, no hints) starts at memd's
documented first batch, not at 1 (issue 14: batch 1 charged a CPU torch process's whole memory
to one sample). The numbers are a real one's: a CPU torch 2.13 process training a 512-512-10 MLP
with AdamW peaked (VmHWM) at 318,376 kB at batch 1 and 319,216 kB at batch 8: the framework's
memory, not the samples'."""
from memd.client import Session
from memd.config import PolicyConfig
from memd.policy.controller import FIRST_BATCH, ControlState, Limits, decide
from memd.policy.fit import Observation, Prior, fit

KiB, MiB, GiB = 2 ** 10, 2 ** 20, 2 ** 30
CFG = PolicyConfig()
AT_1, AT_8 = 318376 * KiB, 319216 * KiB  # measured VmHWM of the torch process above


def first_plan(limits: Limits, curve=None):
    return decide(curve, None, limits, ControlState(), "ok", CFG).plan


def test_no_default_starts_at_the_documented_first_batch_and_says_so():
    plan = first_plan(Limits())
    assert plan.batch_size == FIRST_BATCH == 8
    assert plan.reason.startswith("starting at 8: no reports yet, and no default_batch, target or model hints")
    assert first_plan(Limits(max_batch=4)).batch_size == 4  # the job's own limits still bind it
    assert first_plan(Limits(min_batch=12)).batch_size == 12
    assert first_plan(Limits(default_batch=1)).batch_size == 1  # a default the job gave is its own
    assert first_plan(Limits(target=6)).batch_size == 6


def test_model_hints_start_from_the_prior_instead():
    curve = fit([], Prior(2 * GiB, 100 * MiB))
    decision = decide(curve, None, Limits(), ControlState(), "ok", CFG, budget_bytes=12 * GiB)
    assert decision.plan.reason.startswith("starting at %d from the prior estimate" % decision.plan.batch_size)
    assert decision.plan.batch_size == curve.max_batch(12 * GiB) // 2 == 51  # half what the prior allows


def _after_two_steps(batch: int, peak: int, budget: int):
    """The plan once the job's warm-up step and one more at ``batch`` are known, in host memory."""
    curve = fit([Observation(batch, peak, warmup=True), Observation(batch, peak)], kills=True)
    return decide(curve, None, Limits(), ControlState(batch=batch, stable=2), "ok", CFG, latest_peak=peak,
                  latest_batch=batch, budget_bytes=budget).plan


def test_the_framework_at_the_first_batch_leaves_room_to_grow():
    """In a 512 MiB budget the framework's 311 MiB at batch 1 bounds a sample at all of it: the
    plan stays at 1 for good, and no smaller batch is left to measure the slope against. At
    memd's first batch the same memory is an eighth as much per sample, and the plan grows."""
    stuck = _after_two_steps(1, AT_1, 512 * MiB)
    assert stuck.batch_size == 1, stuck.reason
    grown = _after_two_steps(FIRST_BATCH, AT_8, 512 * MiB)
    assert grown.batch_size > FIRST_BATCH, grown.reason


def test_a_session_without_a_default_is_planned_the_first_batch_by_the_real_daemon(memd):
    with Session(job="gives-nothing", endpoint=memd.endpoint, timeout=2.0) as s:
        plan = s.plan()
    assert plan.source == "daemon" and plan.batch_size == FIRST_BATCH, plan


def test_one_batch_size_is_shown_as_a_bound_not_as_a_cost_per_sample():
    """One batch size bounds a sample at all of its peak (52 fit 2 GiB so); where an overshoot
    kills, twice the batch is the most one move goes past it."""
    near = _after_two_steps(FIRST_BATCH, AT_8, 0.5 * GiB)
    assert FIRST_BATCH < near.batch_size <= 2 * FIRST_BATCH, near.reason
    assert near.reason.startswith("%d fits: at most" % near.batch_size), near.reason
    assert "counting all of the 0.30 GiB at 8 as its samples' until a second batch size" in near.reason, near.reason
    far = _after_two_steps(FIRST_BATCH, AT_8, 2 * GiB)
    assert far.batch_size == 2 * FIRST_BATCH, far.reason
    assert far.reason.startswith("16: at most 2x 8, the largest batch"), far.reason

"""The promises every plan keeps (memd/policy/invariants.py), over generated pools, curves,
histories and pools shared by several sessions. Each property failed on the policy before them;
the numbers in the named cases are reads of real processes (bench/exam.py, the README's loop)."""
import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from memd.config import PolicyConfig
from memd.planner import plan_session
from memd.policy.budget import Pool, host_pool, rise_within
from memd.policy.controller import ControlState, Limits, decide
from memd.policy.fit import Observation, convex_past, fit
from memd.sampling.snapshot import Cgroup, JobMemory, ProcessMemory, Snapshot, SystemMemory
from memd.sessions import SessionRecord

MiB, GiB = 2 ** 20, 2 ** 30
CFG = PolicyConfig()


def host(total=24 * GiB, available=23 * GiB):
    return Snapshot(taken_at=0.0, monotonic=0.0, host="n", memory_model="cpu",
                    system=SystemMemory(total, available, total - available, 0, 0), pressure=None, cgroup=None)


# -- 1. a budget never passes its pool --------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(limit=st.integers(256, 8192), usage=st.integers(0, 8192), rss=st.integers(1, 8192), files=st.integers(0, 600),
       reclaimable=st.integers(0, 2048))
def test_a_groups_budget_never_passes_its_limit_less_the_margin(limit, usage, rss, files, reclaimable):
    """Whatever the reads (a trainer whose libraries another group paid for, reads a moment apart),
    the budget of a job whose peaks the daemon measures stays within its group's limit less the
    margin. Counting the trainer's whole resident set, file pages too, a job in a 1 GiB group was
    budgeted 1028 MiB (bench/examjob.py, 100 MiB fixed, 13 MiB a sample)."""
    assume(files < rss)
    cg = Cgroup(1, "/job", limit * MiB, usage * MiB, reclaimable_bytes=min(reclaimable, usage) * MiB)
    job = JobMemory(pid=7, processes=(), cgroup=cg, errors=(), monotonic=1.0, trainer_rss_bytes=rss * MiB,
                    trainer_file_bytes=files * MiB)
    pool = host_pool(host(), job, CFG)
    assert pool.budget(held_peak=rss * MiB) <= pool.limit_bytes - pool.margin_bytes


@settings(max_examples=300, deadline=None)
@given(available=st.integers(0, 24 * 1024), rss=st.integers(1, 24 * 1024))
def test_the_hosts_budget_never_passes_memtotal_less_the_os_reserve(available, rss):
    """The README's loop on the host, 2 cores / 23.5 GiB: its budget reached 27.8 GB, 110 % of
    MemTotal, the host's free memory read between steps and the trainer's resident set at a step's
    peak. Read at once or not, the budget stays within MemTotal less the OS reserve and margin."""
    job = JobMemory(pid=7, processes=(), cgroup=None, errors=(), monotonic=1.0, trainer_rss_bytes=rss * MiB,
                    trainer_file_bytes=0, available_bytes=available * MiB)
    pool = host_pool(host(), job, CFG)
    assert pool.budget(held_peak=rss * MiB) <= pool.limit_bytes - pool.margin_bytes < host().system.total_bytes


# -- 1. a plan's predicted peak fits its budget ------------------------------------------------

pools = st.builds(lambda capacity, free, own: Pool("host", "cpu", capacity * MiB, min(free, capacity) * MiB,
                                                   own * MiB, 8 * MiB),
                  st.integers(512, 65536), st.integers(0, 65536), st.integers(0, 4096))
histories = st.lists(st.tuples(st.integers(1, 512), st.integers(50, 8000)), min_size=1, max_size=12)


@settings(max_examples=400, deadline=None)
@given(pools, histories, st.integers(1, 1024), st.sampled_from(("ok", "elevated", "critical")))
def test_no_plan_predicts_more_than_its_budget(pool, history, batch, level):
    """Where an overshoot kills, whatever the curve, the state and the moves, the plan's predicted
    peak (Curve.upper) is within its budget, unless even min_batch does not fit."""
    reports = [Observation(b, p * MiB) for b, p in history]
    curve = fit(reports, noise=CFG.peak_spread_host, kills=True)
    d = decide(curve, pool, Limits(), ControlState(batch=batch), level, CFG, latest_batch=history[-1][0],
               latest_peak=history[-1][1] * MiB)
    if d.plan.batch_size > 1:
        assert d.predicted_peak_bytes <= d.budget_bytes, d.plan.reason
    assert d.budget_bytes <= pool.bound_bytes


@settings(max_examples=400, deadline=None)
@given(pools, histories, st.integers(1, 1024))
def test_past_the_largest_batch_run_a_move_grows_at_most_max_growth(pool, history, batch):
    """The README's loop went 32 -> 2137 in one move on a curve from one batch size, and the kernel
    killed it later on a doubling; past the largest batch it has run, a job where an overshoot
    kills grows by max_growth at most."""
    curve = fit([Observation(b, p * MiB) for b, p in history], noise=CFG.peak_spread_host, kills=True)
    d = decide(curve, pool, Limits(), ControlState(batch=batch), "ok", CFG, latest_batch=history[-1][0],
               latest_peak=history[-1][1] * MiB)
    ran = max(b for b, _ in curve.observed)
    assert d.plan.batch_size <= max(ran + 1, int(ran * CFG.max_growth), batch), d.plan.reason


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 4000), st.integers(0, 40), st.floats(0.0, 0.2), st.integers(1, 200), st.integers(2, 400),
       st.integers(500, 60000))
def test_past_the_largest_batch_run_the_convex_bound_holds_every_quadratic(fixed, linear, quad, b1, b2, budget):
    """A step's memory grows with the batch no faster than fixed + a b + q b^2 (a contrastive loss's
    b x b logits are the q term). Past the two largest batch sizes measured, the convex bound is
    never below such a curve, so the plan it allows (Curve.safe_batch) fits: a line through two
    batch sizes of a quadratic job planned past what it could hold (bench/exam.py)."""
    assume(b1 < b2)
    truth = lambda b: fixed + linear * b + quad * b * b + 1  # noqa: E731  MiB
    beyond = (b1, truth(b1), b2, truth(b2))
    for b in (b2 + 1, 2 * b2, 5 * b2):
        assert convex_past(beyond, b, 0.0) >= truth(b) * (1 - 1e-9)
    reports = [Observation(b, math.ceil(truth(b) * MiB)) for b in (b1, b1, b2, b2)]  # whole bytes, never below
    curve = fit(reports, kills=True)
    safe = min(curve.safe_batch(budget * MiB), int(b2 * CFG.max_growth))  # a move goes 2x past b2 at most
    if safe > b2:
        assert truth(safe) * MiB <= budget * MiB


# -- 3. one read cuts by half at most ----------------------------------------------------------

def test_a_read_that_contradicts_the_plan_cuts_by_half_and_the_next_read_confirms():
    """The shared-memory job in a 1 GiB group: one read caught a step's /dev/shm batch freed a moment
    after the trainer unmapped it, and the plan went 66 -> 2 -> 66. A deep cut on one read goes
    half way, the budget before standing for it; a second read that says the same goes all the way."""
    curve = fit([Observation(32, 400 * MiB), Observation(32, 401 * MiB), Observation(66, 820 * MiB),
                 Observation(66, 821 * MiB)], kills=True)
    before = ControlState(batch=66, budget=900 * MiB)
    low = Pool("host", "cpu", GiB, 250 * MiB, 0, 8 * MiB)  # one read: 0.25 GiB of budget
    first = decide(curve, low, Limits(), before, "ok", CFG, latest_batch=66, latest_peak=820 * MiB, read=1.0)
    assert first.plan.batch_size == 33 and "the most one read cuts" in first.plan.reason
    assert first.predicted_peak_bytes <= first.budget_bytes == 900 * MiB
    same = decide(curve, low, Limits(), first.state, "ok", CFG, latest_batch=66, latest_peak=820 * MiB, read=1.0)
    assert same.plan.batch_size == 33  # the same read again confirms nothing
    confirmed = decide(curve, low, Limits(), first.state, "ok", CFG, latest_batch=66, latest_peak=820 * MiB, read=2.0)
    assert confirmed.plan.batch_size < 33 and confirmed.budget_bytes == 250 * MiB - 8 * MiB
    critical = decide(curve, low, Limits(), before, "critical", CFG, latest_batch=66, latest_peak=820 * MiB, read=1.0)
    assert critical.plan.batch_size < 33  # a nearly full pool is cut at once


# -- the pool's sessions together -------------------------------------------------------------

def session(sid, pid, batch, peaks):
    s = SessionRecord(token="t%d" % sid, sid=sid, job="j%d" % sid, pid=pid, host="h", local=True, start_time=None,
                      limits=Limits(default_batch=batch), created=0.0, last_seen=0.0)
    for i, (b, p) in enumerate(peaks):
        s.observe(Observation(b, p * MiB, warmup=i == 0))
        s.latest_batch, s.latest_peak = b, p * MiB
        s.note_peak(-1.0, p * MiB)
    s.state = ControlState(batch=batch)
    return s


def trainer_job(pid, held_mib, cg, at=1.0):
    trainer = ProcessMemory(pid, 1, "python", held_mib * MiB, held_mib * MiB, held_mib * MiB)
    return JobMemory(pid=pid, processes=(trainer,), cgroup=cg, errors=(), monotonic=at,
                     trainer_rss_bytes=held_mib * MiB, trainer_file_bytes=0)


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 3), st.integers(100, 600), st.integers(2, 16), st.lists(st.booleans(), min_size=3, max_size=3))
def test_the_sessions_of_one_pool_together_plan_no_more_than_it_holds(n, fixed, per_sample, between):
    """Two copies of one job in a 3 GiB group, alone each fitting 860, were planned 418 and 456:
    3.72 GiB together, each counting the other at the largest peak it had reported while the
    group's free memory counted it between steps. However each is caught (at its peak or between
    steps), the plans of one pool's sessions predict no more than its limit less the margin."""
    limit = 3 * GiB
    steps = [(16, fixed + 16 * per_sample), (32, fixed + 32 * per_sample), (32, fixed + 32 * per_sample)]
    sessions = [session(i + 1, 100 + i, 32, [steps[0]] + steps) for i in range(n)]
    held = [fixed + (0 if between[i] else 32 * per_sample) for i in range(n)]
    cg = Cgroup(1, "/shared", limit, sum(held) * MiB, reclaimable_bytes=0)
    jobs = {100 + i: trainer_job(100 + i, held[i], cg) for i in range(n)}
    for _ in range(3):  # each decides, and again as the others' plans move
        for s in sessions:
            plan_session(s, host(), "ok", sessions, jobs, CFG)
    assert sum(s.predicted_peak_bytes for s in sessions) <= limit - 0.01 * limit


# -- a neighbour's growth ----------------------------------------------------------------------

def test_what_a_neighbour_added_within_a_step_is_held_back_again():
    """A neighbour growing 100 MiB every 3 s beside a job whose steps take 2-7 s: the most it rose
    within one step's window, not its total, is held back until a plan can answer it."""
    reads = [(t * 0.2, 100 * MiB + (int(t * 0.2 // 3) * 100 * MiB)) for t in range(60)]  # 12 s
    assert rise_within(reads, 2.4) == 100 * MiB
    assert rise_within(reads, 6.4) == 300 * MiB
    assert rise_within([(0.0, 500 * MiB), (1.0, 100 * MiB)], 5.0) == 0  # a neighbour that shrinks holds nothing back
    assert rise_within([], 1.0) == 0


def test_a_neighbours_growth_is_held_back_from_the_jobs_budget():
    """The job in a 2 GiB group beside another process of the group that grew 100 MiB at a time:
    the budget followed 3.5-5 s late and every run was killed. Read at each sample (0.2 s) with the
    trainer, the neighbour's rise within one of the job's steps comes off the budget at once."""
    s = session(1, 100, 64, [(32, 400), (32, 420), (64, 740), (64, 742)])
    s.reported_at.extend([0.0, 2.0, 4.0])  # steps of 2 s
    budgets = []
    for i, beside in enumerate((100, 100, 200, 200, 300, 300)):  # MiB the neighbour holds, read 0.2 s apart
        cg = Cgroup(1, "/job", 2 * GiB, (400 + beside) * MiB, reclaimable_bytes=0)
        job = trainer_job(100, 400, cg, at=1.0)
        job = JobMemory(job.pid, job.processes, cg, (), 1.0, 400 * MiB, trainer_file_bytes=0, paired_at=1.0 + i * 0.2)
        budgets.append(plan_session(s, host(), "ok", [s], {100: job}, CFG).budget_bytes)
    # A drop is believed on its second read (planner.steadied): then 100 MiB less free, and 100
    # more held back for what the neighbour may add within the job's next step.
    assert budgets[0] == budgets[1] == budgets[2]
    assert budgets[2] - budgets[3] == 200 * MiB
    assert budgets[3] - budgets[5] == 200 * MiB  # 300: 100 less free again, and 200 risen within the window


def test_invariants_are_checked_last_whatever_the_moves_decided():
    """A batch after an out-of-memory error, at the job's max_batch or held by pressure: the plan
    fits its budget all the same (every move goes through invariants.keep_promises)."""
    curve = fit([Observation(8, 200 * MiB), Observation(8, 201 * MiB), Observation(16, 300 * MiB),
                 Observation(16, 301 * MiB)], kills=True)
    pool = Pool("host", "cpu", GiB, 250 * MiB, 0, 8 * MiB)
    for state in (ControlState(batch=16, ceiling=40, stable=20), ControlState(batch=16)):
        for level in ("ok", "elevated", "high"):
            d = decide(curve, pool, Limits(max_batch=64), state, level, CFG, latest_batch=16, latest_peak=300 * MiB)
            assert d.predicted_peak_bytes <= d.budget_bytes or d.plan.batch_size == 1
    assert math.isfinite(curve.upper(10 ** 6))

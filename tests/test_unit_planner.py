"""The planner (memd/planner.py) on its own: the seam between the session records and the pure
policy, fed fixture Snapshots and records; no sampling, no daemon."""
from hypothesis import example, given
from hypothesis import strategies as st

from memd import claims, planner
from memd.config import PolicyConfig
from memd.policy import budget
from memd.policy.controller import ControlState, Limits
from memd.policy.fit import Observation
from memd.sampling.snapshot import CPU, DISCRETE, Cgroup, Gpu, JobMemory, ProcessMemory, Snapshot, SystemMemory
from memd.sessions import SessionRecord, Sessions

GiB = 2 ** 30
CFG = PolicyConfig()


def snap(model=CPU, gpus=(), total=64 * GiB, available=48 * GiB, monotonic=10.0):
    return Snapshot(taken_at=0.0, monotonic=monotonic, host="h", memory_model=model,
                    system=SystemMemory(total, available, total - available, 0, 0), pressure=None, cgroup=None,
                    gpus=tuple(gpus))


def gpu(index, uuid, name="NVIDIA H100", total=80 * GiB, used=GiB):
    return Gpu(index, uuid, name, total, used, total - used, 0, False)


def record(pid=7, local=True, **fields):
    fields.setdefault("limits", Limits())
    return SessionRecord(token="t%d" % pid, sid=pid, job="j", pid=pid, host="h", local=local, start_time=None,
                         created=0.0, last_seen=0.0, **fields)


def test_a_jobs_key_says_its_configuration_and_owner_and_nothing_of_its_data_loading():
    plain = record()
    assert planner.configuration(plain) == "" and planner.ownership(plain) == ""
    model = record(hints={"layers": 12, "num_workers": 4}, owner=1000)
    same_model = record(hints={"layers": 12, "num_workers": 8, "prefetch_factor": 4}, owner=1000)
    other = record(hints={"layers": 24}, owner=1000)
    capped = record(hints={"layers": 12}, limits=Limits(max_batch=64), owner=1000)
    assert planner.comparable(model) == planner.comparable(same_model)
    assert len({planner.configuration(r) for r in (model, other, capped)}) == 3
    assert planner.configuration(model).startswith("#") and planner.ownership(model) == "@uid:1000"


def test_identify_names_the_pool_a_job_will_run_in_or_waits_for_its_gpu():
    h100s = snap(DISCRETE, [gpu(0, "GPU-a"), gpu(1, "GPU-b")])
    assert planner.identify(record(), h100s, CFG) == "gpu:NVIDIA H100:%d" % (80 * GiB)  # alike: either one
    mixed = snap(DISCRETE, [gpu(0, "GPU-a"), gpu(1, "GPU-b", name="NVIDIA A100", total=40 * GiB)])
    assert planner.identify(record(), mixed, CFG) is None  # unlike and unnamed: not known yet
    assert planner.identify(record(device_uuid="GPU-b"), mixed, CFG) == "gpu:NVIDIA A100:%d" % (40 * GiB)
    assert planner.identify(record(device="cpu"), mixed, CFG) == "discrete:64"  # on the CPU: the host
    boxed = record(cgroup=Cgroup(2, "/job", 8 * GiB, GiB))
    assert planner.identify(boxed, snap(), CFG) == "cpu:8"  # its own cgroup, read at hello


def test_only_watched_sessions_in_the_same_pool_count_as_neighbours():
    me = record(1, pool="host")
    near = record(2, pool="host", predicted_peak_bytes=3 * GiB)
    near.note_peak(5.0, GiB)
    others = [me, near, record(3, pool="GPU-a"), record(4, local=False, pool="host")]
    found = planner.neighbours(me, "host", others, at=6.0)
    assert found.listed() == [claims.Neighbour(GiB, 3 * GiB, None)]
    assert found.growth == 2 * GiB  # promised to it, not yet in use
    pool = budget.Pool("host", CPU, 64 * GiB, 40 * GiB, None, GiB)
    alone = planner.neighbours(me, "host", [me], at=6.0)
    assert planner.share_for(me, pool, 30 * GiB, alone, 6.0) is None  # alone: no share to keep to
    assert planner.share_for(me, pool, 30 * GiB, found, 6.0) == 31 * GiB // 2  # half of what the two may hold


def fair_kept(others, equal):
    """budget.fair_share's sum, written out: what each other session keeps at an equal share."""
    return sum(max(o.held, equal if o.wanted is None else min(o.wanted, equal)) for o in others)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.none() | st.integers(0, 60)), max_size=12),
       st.lists(st.integers(0, 15), max_size=6), st.integers(0, 70))
@example([(5, 5, 5), (3, 3, None), (7, 7, 2)], [1], 5)  # equal shares at the very thresholds
def test_claims_read_fair_share_sums_as_written(claimed, dropped, equal):
    """Claims.kept, read by bisection of sorted claims, is fair_share's sum over every member, and
    Others.kept the same without one's own, through puts that replace and drops."""
    kept = claims.Claims(0.0, 0)
    for index, held, wanted in claimed:
        kept.put(index % 8, claims.Neighbour(held, None, wanted))  # the same sid again replaces
    for sid in dropped:
        kept.drop(sid)
    assert kept.kept(equal) == fair_kept(kept.members.values(), equal)
    for sid in kept.members:
        assert kept.others(sid).kept(equal) == fair_kept(kept.others(sid).listed(), equal)
    assert kept.held == sum(c.held for c in kept.members.values())


def test_claims_kept_as_sessions_decide_are_the_claims_read_whole():
    """The registry's running sums (planner.neighbours with Sessions.claims, record_claim) stay
    what a scan of every session gives, as sessions decide, move pools, and end."""
    sessions = Sessions(16, 600.0, clock=lambda: 0.0, alive=lambda s: True)
    records = [sessions.open(job="j%d" % i, pid=i, host="h", local=i != 3, start_time=None, limits=Limits())
               for i in range(6)]
    for i, r in enumerate(records):
        r.pool = "host"
        r.note_peak(1.0, (i + 1) * GiB)
        r.predicted_peak_bytes = (i + 2) * GiB
        r.wanted_peak_bytes = None if i % 2 else (i + 3) * GiB
    at = 2.0

    def agree():
        for r in records:
            kept = planner.neighbours(r, "host", sessions, at)
            read = claims.gather(list(sessions), "host", at).others(r.sid)
            assert (kept.number, kept.held, kept.growth, sorted(kept.listed())) \
                == (read.number, read.held, read.growth, sorted(read.listed()))
            for equal in (0, GiB, 5 * GiB, 20 * GiB):
                assert kept.kept(equal) == read.kept(equal) == fair_kept(read.listed(), equal)

    agree()
    records[1].predicted_peak_bytes, records[1].wanted_peak_bytes = 9 * GiB, 7 * GiB  # a new plan
    planner.record_claim(records[1], sessions, "host", at)
    records[1].note_peak(3.0, 8 * GiB)  # a report after the snapshot: not what it held then
    agree()
    records[2].pool = "GPU-a"  # its GPU is known now
    planner.record_claim(records[2], sessions, "host", at)
    agree()
    sessions.close(records[4].token)  # ended: gathered again
    records.pop(4)
    agree()
    assert planner.neighbours(records[0], "host", sessions, at).number == 2  # 1 and 5: not 3 (unwatched) nor 2


def test_a_host_pools_room_is_the_larger_of_two_job_reads():
    s = record()
    job = JobMemory(7, (), None, (), monotonic=1.0, trainer_rss_bytes=GiB)
    first = planner.steadied(budget.Pool("host", CPU, 16 * GiB, 4 * GiB, GiB, GiB), s, job)
    low = planner.steadied(budget.Pool("host", CPU, 16 * GiB, 3 * GiB, GiB, GiB), s,
                           JobMemory(7, (), None, (), monotonic=2.0, trainer_rss_bytes=GiB))
    assert first.free_bytes == 4 * GiB and low.free_bytes == 4 * GiB  # one low read is not believed
    later = planner.steadied(budget.Pool("host", CPU, 16 * GiB, 2 * GiB, GiB, GiB), s,
                             JobMemory(7, (), None, (), monotonic=3.0, trainer_rss_bytes=GiB))
    assert later.free_bytes == 3 * GiB  # two low reads in a row are


def test_plan_session_records_its_decision_on_the_session():
    s = record(limits=Limits(default_batch=8, max_batch=4096))
    trainer = ProcessMemory(7, 1, "python", 2 * GiB, 2 * GiB, 2 * GiB)
    job = JobMemory(7, (trainer,), None, (), monotonic=10.0, trainer_rss_bytes=2 * GiB)
    for batch, peak in ((8, 2 * GiB + 8 * 2 ** 20), (8, 2 * GiB + 8 * 2 ** 20), (16, 2 * GiB + 16 * 2 ** 20)):
        s.observe(Observation(batch, peak))
    s.note_peak(9.0, 2 * GiB + 16 * 2 ** 20)
    decision = planner.plan_session(s, snap(), "ok", [s], {7: job}, CFG)
    assert s.plan is decision.plan and s.pool == budget.HOST and s.budget_bytes == decision.budget_bytes
    assert decision.plan.source == "daemon" and 16 <= decision.plan.batch_size <= 4096
    assert s.wanted_peak_bytes is not None


def test_a_job_whose_gpu_cannot_be_told_keeps_its_default_and_says_why():
    s = record(limits=Limits(default_batch=8))
    mixed = snap(DISCRETE, [gpu(0, "GPU-a"), gpu(1, "GPU-b", name="NVIDIA A100", total=40 * GiB)])
    decision = planner.plan_session(s, mixed, "ok", [s], {}, CFG)
    assert decision.plan.batch_size == 8 and "which GPU this job runs on is not known yet" in decision.plan.reason
    assert s.pool is None  # not measured meanwhile: host RSS would teach a GPU job the wrong memory


def test_the_pressure_in_a_jobs_own_cgroup_raises_its_level_over_the_hosts():
    """The host says ok and the job's own 2 GiB group thrashes: the group's level is the job's,
    with the host's hysteresis. Its PSI where it has one (v2); on v1 its faults (the job fixed at
    135 in the four-workers benchmark, pressure.thrashing); nothing from a group with no limit.
    v2's PSI comes as a constructed record: this machine's memory controller is v1, and the real
    v1 path is tests/test_cgroup_pressure.py's."""
    from memd.sampling.snapshot import Pressure

    MiB, page = 2 ** 20, 4096
    trainer = ProcessMemory(7, 1, "python", 800 * MiB, 800 * MiB, 800 * MiB)

    def job(at, pages, faults, used=2040, limit=2048 * MiB, pressure=None, v=1):
        cg = Cgroup(v, "/memd-bench", limit, used * MiB, refault_bytes=pages * page, major_faults=faults,
                    pressure=pressure)
        return JobMemory(7, (trainer,), cg, (), monotonic=at, trainer_rss_bytes=800 * MiB)

    s = record()
    counts = ((410.6, 28922, 138), (418.2, 28922, 138), (419.4, 47994, 199), (421.3, 113273, 391),
              (422.0, 118329, 419))
    assert [planner.group_level(s, job(*c), CFG) for c in counts] == ["ok"] * 4 + ["critical"]
    assert planner.group_level(s, job(422.0, 118329, 419), CFG) == "critical"  # the same read: no new word
    # No page back for 10 s, then 10 s calm, and the level comes down.
    assert planner.group_level(s, job(432.5, 118329, 419), CFG) == "critical"
    assert planner.group_level(s, job(443.0, 118329, 419), CFG) == "ok"

    psi = lambda some, full: Pressure(some, some, some, full, full, full, 0.0, 0.0)  # noqa: E731
    v2 = record(pid=8)
    assert planner.group_level(v2, job(1.0, 0, 0, pressure=psi(0.12, 0.0), v=2), CFG) == "elevated"
    assert planner.group_level(v2, job(2.0, 0, 0, pressure=psi(0.3, 0.15), v=2), CFG) == "critical"
    assert planner.group_level(record(pid=9), job(1.0, 0, 0, limit=None, pressure=psi(0.5, 0.5), v=2), CFG) == "ok"

    # The plan says so: at critical it throttles the job's data loading and cuts its batch once.
    s.state = ControlState(batch=135)
    plan = planner.plan_session(s, snap(monotonic=422.0), "ok", [s], {7: job(422.0, 118329, 419)}, CFG).plan
    assert plan.pressure == "critical" and plan.throttle
    assert plan.batch_size == 101 and plan.reason.startswith("cut to 101 from 135: memory pressure is critical")

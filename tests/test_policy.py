"""The policy as pure functions: fitted curves, budgets, pressure levels and the controller."""
import pytest

from memd.config import PolicyConfig
from memd.policy.budget import Pool, fair_share, find_gpu, host_pool
from memd.policy.controller import ControlState, Limits, WorkerFacts, after_oom, after_report, decide
from memd.policy.fit import Curve, Observation, Prior, fit
from memd.policy.pressure import PressureState, Signals, host_signals, next_state, raw_level
from memd.sampling.snapshot import Cgroup, Gpu, GpuProcess, JobMemory, Pressure, Snapshot, SystemMemory

GB = 10 ** 9
CFG = PolicyConfig()


def pool(capacity=80 * GB, free=60 * GB, own=None, kind="discrete", margin=GB):
    return Pool("gpu-0", kind, capacity, free, own, margin)


def test_the_policy_imports_nothing_with_side_effects():
    """Pure functions: importing the policy (and the planner over it) loads no /proc, NVML or
    psutil reader, no logging set-up, no transport (pyzmq, msgpack) and not the client's Session
    (whose module installs a fork hook): only the Plan record it shares with the client."""
    import json
    import subprocess
    import sys

    from realdaemon import memd_env

    code = ("import sys, json; import memd.policy.controller, memd.policy.budget, memd.policy.fit, "
            "memd.policy.pressure, memd.policy.estimate, memd.policy.growth, memd.planner; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('psutil', 'pynvml', 'subprocess', 'zmq', 'msgpack', 'structlog', 'prometheus_client') "
            "or m.startswith('memd.sampling.') and m != 'memd.sampling.snapshot' "
            "or m.startswith('memd.client.') "
            "and m not in ('memd.client.plan', 'memd.client.endpoint', 'memd.client.counts'))))")
    out = subprocess.run([sys.executable, "-c", code], env=memd_env(), capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# -- fit ---------------------------------------------------------------------------------------

def test_one_report_bounds_per_sample_safely():
    curve = fit([Observation(8, 10 * GB)])
    assert curve.source == "bound" and curve.fixed_bytes == 0
    assert curve.peak(8) == pytest.approx(10 * GB)
    # Whatever the true split of the 10 GB, a batch of max_batch(budget) cannot exceed it.
    for fixed in (0, 5 * GB, 9.9 * GB):
        per_sample = (10 * GB - fixed) / 8
        b = curve.max_batch(40 * GB)
        assert fixed + per_sample * b <= 40 * GB


def test_two_batch_sizes_fit_the_line_from_above():
    truth = lambda b: 6 * GB + b * 0.5 * GB  # noqa: E731
    curve = fit([Observation(4, int(truth(4))), Observation(16, int(truth(16)))])
    assert curve.source == "fit" and curve.batch_sizes == 2
    for b in (4, 16, 32, 64):
        assert curve.peak(b) >= truth(b) - 1  # an upper bound where it matters
    assert curve.per_sample_bytes == pytest.approx(0.5 * GB, rel=0.3)


def test_repeated_tight_reports_sharpen_the_slope():
    truth = lambda b: 6 * GB + b * 0.5 * GB  # noqa: E731
    few = fit([Observation(b, int(truth(b))) for b in (4, 16)])
    many = fit([Observation(b, int(truth(b))) for b in (4, 16) for _ in range(4)])
    assert many.peak(64) < few.peak(64)
    assert many.peak(64) == pytest.approx(truth(64), rel=0.05)  # 4x beyond the batches seen
    assert many.confidence > few.confidence


def test_the_band_is_tight_near_the_batches_seen_and_wide_far_from_them():
    """Extrapolating is what is uncertain: the margin above the truth grows with the distance."""
    truth = lambda b: 6 * GB + b * 0.5 * GB  # noqa: E731
    curve = fit([Observation(b, int(truth(b) * (1 + 0.01 * (-1) ** i))) for i, b in enumerate((30, 31, 32, 33, 34))])
    near, far = curve.peak(34) / truth(34), curve.peak(340) / truth(340)
    assert 1.0 <= near < 1.05 < far
    assert curve.max_batch(truth(36) * 1.04) >= 35  # room just beyond the batches seen is used


def test_an_isolated_spike_is_ignored_but_repeated_spikes_count():
    steady = [Observation(8, 10 * GB + i * 10 ** 6) for i in range(6)]
    with_one_spike = steady + [Observation(8, 14 * GB)]
    assert fit(with_one_spike).peak(8) < 10.1 * GB
    with_two = steady + [Observation(8, 14 * GB), Observation(8, 14 * GB)]
    assert fit(with_two).peak(8) >= 14 * GB


def test_rare_spikes_are_ignored_up_to_one_in_ten():
    steady = [Observation(8, 10 * GB + (i % 5) * 10 ** 7) for i in range(18)]
    assert fit(steady + [Observation(8, 13 * GB)] * 2).peak(8) < 10.5 * GB  # 2 in 20: fragmentation
    assert fit(steady + [Observation(8, 13 * GB)] * 4).peak(8) >= 13 * GB  # 4 in 22: the batch's real cost


def test_a_spike_that_flattens_a_two_point_line_is_ramped_not_jumped():
    # The first report spiked: the two points say memory barely grows with the batch.
    curve = fit([Observation(4, 32 * GB), Observation(9, 31 * GB)])
    assert curve.confidence < 0.7
    d = decide(curve, pool(free=40 * GB, own=31 * GB), Limits(), ControlState(batch=9), "ok", CFG,
               latest_peak=31 * GB, latest_batch=9)
    assert d.plan.batch_size == 18 and "ramping" in d.plan.reason


def test_batches_too_close_together_are_probed_once_from_below():
    truth = lambda b: 60 * GB + b * 0.8 * GB  # noqa: E731  mostly fixed: the slope hides in the noise
    reports = [Observation(b, int(truth(b) * (1 + 0.01 * (-1) ** i))) for i, b in enumerate((20, 21, 20, 21))]
    held = max(r.peak_bytes for r in reports)  # the caching allocator keeps the largest peak
    p = pool(capacity=90 * GB, free=4 * GB, own=held, margin=GB)
    d = decide(fit(reports), p, Limits(), ControlState(batch=21), "ok", CFG, latest_peak=reports[-1].peak_bytes,
               latest_batch=21, held_peak=held)
    assert d.plan.batch_size == 10 and "probing" in d.plan.reason
    reports.append(Observation(10, int(truth(10))))
    d = decide(fit(reports), p, Limits(), ControlState(batch=10), "ok", CFG, latest_peak=reports[-1].peak_bytes,
               latest_batch=10, held_peak=held)
    assert d.plan.batch_size >= 21 and "probing" not in d.plan.reason  # one probe was enough


def test_a_batch_that_ran_within_the_budget_is_kept_when_the_slope_is_unknown():
    truth = lambda b: 60 * GB + b * 0.8 * GB  # noqa: E731
    reports = [Observation(b, int(truth(b) * (1 + 0.01 * (-1) ** i))) for i, b in enumerate((20, 21, 20, 21))]
    held = max(r.peak_bytes for r in reports)
    p = pool(capacity=80 * GB, free=2 * GB, own=held, margin=GB)  # no room to probe or grow
    d = decide(fit(reports), p, Limits(), ControlState(batch=21), "ok", CFG, latest_peak=reports[-1].peak_bytes,
               latest_batch=21, held_peak=held)
    assert d.plan.batch_size == 21  # not min_batch: its reports fit, the margin covers their noise


def test_base_bytes_splits_one_report():
    curve = fit([Observation(2, 61 * GB, base_bytes=59 * GB)])
    assert curve.fixed_bytes == 59 * GB and curve.per_sample_bytes == pytest.approx(GB)


def test_a_base_above_the_reports_is_not_in_their_units_and_is_ignored():
    """Memory held between steps is held during every step too: a base of 40 GB beside peaks of
    20 and 30 GB counts something the peaks leave out. Taken as it was, it capped the slope at 0
    and max_batch said 1,048,576 where the line says 36."""
    reports = [(8, 20 * GB), (8, 20 * GB), (16, 30 * GB)]
    line = fit([Observation(b, p) for b, p in reports]).max_batch(60 * GB)
    assert 30 <= line <= 40
    for base in (40 * GB, 20 * GB):  # above the reports, and equal to the lowest
        curve = fit([Observation(b, p, base_bytes=base) for b, p in reports])
        assert curve.max_batch(60 * GB) == line
    one = fit([Observation(8, 20 * GB, base_bytes=40 * GB)])
    assert one.max_batch(60 * GB) == fit([Observation(8, 20 * GB)]).max_batch(60 * GB) == 24
    # A base below every report is still used: the line from it through the highest report,
    # 12 GB + (30 - 12) / 16 GB a sample, lies above every step and allows (60 - 12) / 1.125.
    below = fit([Observation(b, p, base_bytes=12 * GB) for b, p in reports])
    assert below.max_batch(60 * GB) == 42


def test_prior_only_until_reports():
    prior = Prior(10 * GB, GB)
    assert fit([], prior).source == "prior"
    assert fit([]) is None


# -- pressure ----------------------------------------------------------------------------------

def signals(some=0.0, full=0.0, available=0.5):
    return Signals(some, full, available)


@pytest.mark.parametrize("sig, level", [
    (signals(), "ok"),
    (signals(some=0.10), "elevated"),
    (signals(some=0.30), "high"),
    (signals(full=0.10), "critical"),
    (signals(available=0.01), "critical"),
    (Signals(None, None, 0.5, apple_level=4), "critical"),
    (Signals(None, None, 0.5, apple_level=2), "high"),
])
def test_pressure_thresholds(sig, level):
    assert raw_level(sig, CFG) == level


def test_pressure_rises_at_once_and_falls_after_calm():
    state = PressureState()
    state = next_state(state, signals(some=0.3), 0.0, CFG)
    assert state.level == "high"
    state = next_state(state, signals(some=0.22), 1.0, CFG)  # below 25 % but above 80 % of it
    assert state.level == "high" and state.calm_since is None
    state = next_state(state, signals(some=0.01), 2.0, CFG)
    assert state.level == "high"  # calm, but not for long enough
    state = next_state(state, signals(some=0.01), 2.0 + CFG.calm_seconds, CFG)
    assert state.level == "ok"


# -- budget ------------------------------------------------------------------------------------

def test_fair_share_splits_a_pool_max_min():
    assert fair_share(60 * GB, 0, [(0, 100 * GB)]) == 30 * GB  # both want it all: halves
    assert fair_share(60 * GB, 0, [(0, 10 * GB)]) == 50 * GB  # the other wants little: the rest is ours
    assert fair_share(60 * GB, 0, [(0, None)]) == 30 * GB  # the other does not know yet: it keeps a half
    assert fair_share(60 * GB, 0, [(45 * GB, 50 * GB)]) == 15 * GB  # what the other holds is not taken back
    assert fair_share(60 * GB, 40 * GB, [(20 * GB, 60 * GB)]) == 40 * GB  # nor what we hold
    assert fair_share(90 * GB, 0, [(0, 100 * GB), (0, 5 * GB)]) == 55 * GB
    capped = pool(free=60 * GB, own=None, margin=0).with_share(20 * GB)
    assert capped.budget(held_peak=None) == 20 * GB and capped.budget(held_peak=0) == 20 * GB


def test_budget_counts_what_the_job_holds_in_its_reported_units():
    # 20 GB free, the job holds 30 GB of which its reports count 25 GB (the rest: context etc).
    p = pool(capacity=80 * GB, free=20 * GB, own=30 * GB, margin=2 * GB)
    assert p.budget(held_peak=25 * GB) == 20 * GB + 25 * GB - 2 * GB
    assert p.with_reserved(5 * GB).budget(25 * GB) == 38 * GB
    unknown = pool(free=20 * GB, own=None, margin=2 * GB)
    assert unknown.budget(held_peak=25 * GB) == 43 * GB


def host_snapshot(cgroup):
    return Snapshot(taken_at=0.0, monotonic=0.0, host="n", memory_model="cpu",
                    system=SystemMemory(64 * GB, 40 * GB, 24 * GB, 0, 0), pressure=None, cgroup=cgroup)


def test_a_job_is_bounded_by_its_own_cgroup_not_by_the_daemons_service():
    service = Cgroup(2, "/system.slice/memd.service", 256 * 2 ** 20, 100 * 2 ** 20, working_set_bytes=90 * 2 ** 20)
    snap = host_snapshot(service)
    # memd.service's MemoryMax bounds memd, not the jobs: a job not yet read sees the host.
    assert host_pool(snap, None, CFG).capacity_bytes == 64 * GB
    assert host_signals(snap).available_ratio == 40 / 64
    # A job in an 8 GB Slurm cgroup, 5 GB of it in use: that cgroup is its ceiling.
    slurm = Cgroup(1, "/slurm/uid_1000/job_7", 8 * GB, 6 * GB, working_set_bytes=5 * GB)
    job = JobMemory(pid=7, processes=(), cgroup=slurm, errors=(), monotonic=0.0)
    p = host_pool(snap, job, CFG)
    assert (p.capacity_bytes, p.free_bytes) == (8 * GB, 3 * GB)


def test_a_containers_cgroup_bounds_every_job_in_it():
    container = Cgroup(2, "/", 16 * GB, 12 * GB, working_set_bytes=10 * GB, pressure=Pressure(0.3, 0, 0, 0, 0, 0, 0, 0))
    snap = host_snapshot(container)
    p = host_pool(snap, None, CFG)
    assert (p.capacity_bytes, p.free_bytes) == (16 * GB, 6 * GB)
    signals = host_signals(snap)
    assert signals.available_ratio == 6 / 16 and signals.some_avg10 == 0.3  # the container's own stalls


def gpu(index, uuid, pids=()):
    return Gpu(index, uuid, "H100", 80 * GB, 10 * GB, 70 * GB, 0, False,
               processes=tuple(GpuProcess(p, GB) for p in pids))


def test_find_gpu_by_uuid_then_visible_devices_then_processes():
    gpus = [gpu(0, "GPU-aaaa"), gpu(1, "GPU-bbbb", pids=[42])]
    assert find_gpu(gpus, device_uuid="bbbb").uuid == "GPU-bbbb"  # torch's uuid has no prefix
    assert find_gpu(gpus, device="cuda:0", visible="1").uuid == "GPU-bbbb"  # CUDA index 0 is NVML 1
    assert find_gpu(gpus, device="cuda:0", visible="GPU-bb").uuid == "GPU-bbbb"
    assert find_gpu(gpus, pids=[42]).uuid == "GPU-bbbb"
    assert find_gpu(gpus, device="cuda:0").uuid == "GPU-aaaa"
    assert find_gpu(gpus) is None  # two GPUs and nothing to tell them apart


def test_find_gpu_takes_no_index_from_digits_int_refuses():
    """"²".isdigit() is true and int("²") raises: a hello naming it was an internal error (bench/fuzz.py)."""
    gpus = [gpu(0, "GPU-aaaa"), gpu(1, "GPU-bbbb")]
    assert find_gpu(gpus, device="cuda:²") is None
    assert find_gpu(gpus, device="cuda:0", visible="²,1") is None
    assert find_gpu(gpus, device="cuda:1", visible="²,1").uuid == "GPU-bbbb"


# -- controller --------------------------------------------------------------------------------

def test_first_plan_is_the_default_or_a_cautious_prior():
    d = decide(None, pool(), Limits(default_batch=32), ControlState(), "ok", CFG)
    assert d.plan.batch_size == 32 and "no reports yet" in d.plan.reason
    prior = fit([], Prior(10 * GB, GB))
    d = decide(prior, pool(), Limits(), ControlState(), "ok", CFG)
    fits = prior.max_batch(pool().budget(None))
    assert d.plan.batch_size == fits // 2  # never a blind jump on a prior alone
    d = decide(prior, pool(), Limits(default_batch=500), ControlState(), "ok", CFG)
    assert d.plan.batch_size == fits  # a default the prior says cannot fit is lowered


def test_plan_jumps_to_what_the_bound_proves_safe():
    curve = fit([Observation(8, 10 * GB)])
    p = pool(free=50 * GB, own=10 * GB, margin=GB)
    d = decide(curve, p, Limits(), ControlState(batch=8), "ok", CFG, latest_peak=10 * GB, latest_batch=8)
    assert d.plan.batch_size == int(8 * p.budget(10 * GB) / (10 * GB))
    assert d.predicted_peak_bytes <= d.budget_bytes


def test_oom_cuts_a_quarter_holds_then_grows_back_to_the_ceiling():
    curve = Curve(0, 0.5 * GB, "fit", 3, 1.0)  # says 100+ fits: the OOM knows better
    limits = Limits()
    state = after_oom(ControlState(batch=40), 40, limits, CFG)
    assert state.batch == 30 and state.ceiling == 39
    big = pool(free=70 * GB, own=0)
    d = decide(curve, big, limits, state, "ok", CFG, latest_peak=15 * GB, latest_batch=30)
    assert d.plan.batch_size == 30 and "held until 10 stable steps" in d.plan.reason
    state = d.state
    for _ in range(CFG.stable_steps):
        state = after_report(state, 30)
    batches = []
    for _ in range(6):  # then back, halving the distance to the ceiling with each clean report
        d = decide(curve, big, limits, state, "ok", CFG, latest_peak=15 * GB, latest_batch=state.batch)
        batches.append(d.plan.batch_size)
        state = after_report(d.state, d.plan.batch_size)
    assert batches == [35, 37, 38, 39, 39, 39], batches
    assert "ceiling 39" in d.plan.reason


def test_a_remembered_ceiling_caps_the_first_plan():
    state = ControlState(ceiling=24, stable=CFG.stable_steps)  # what hello restores from the last run
    d = decide(None, pool(), Limits(default_batch=32), state, "ok", CFG)
    assert d.plan.batch_size == 24 and "ceiling" in d.plan.reason


def test_workers_on_a_discrete_gpu_are_paid_from_host_memory():
    curve = Curve(GB, GB, "fit", 3, 1.0)
    gpu_pool = pool(capacity=80 * GB, free=60 * GB, margin=40 * GB)  # a huge GPU margin must not starve the host
    d = decide(curve, gpu_pool, Limits(num_workers=4), ControlState(batch=8), "ok", CFG,
               workers=WorkerFacts(uss=(2 * GB,) * 4), host_total_bytes=64 * GB, host_free_bytes=10 * GB)
    assert d.plan.num_workers == 4, d.plan.reason


def test_pressure_holds_growth_and_critical_cuts_once_and_throttles():
    curve = Curve(0, 0.1 * GB, "fit", 3, 1.0)
    state = ControlState(batch=20)
    d = decide(curve, pool(), Limits(), state, "elevated", CFG, latest_peak=2 * GB, latest_batch=20)
    assert d.plan.batch_size == 20 and not d.plan.throttle and d.plan.pressure == "elevated"
    d = decide(curve, pool(), Limits(), state, "critical", CFG, latest_peak=2 * GB, latest_batch=20)
    assert d.plan.batch_size == 15 and d.plan.throttle
    again = decide(curve, pool(), Limits(), d.state, "critical", CFG, latest_peak=2 * GB, latest_batch=15)
    assert again.plan.batch_size == 15  # once per episode, not on every request


def test_limits_and_target_are_respected():
    curve = Curve(GB, 0.1 * GB, "fit", 3, 1.0)
    d = decide(curve, pool(), Limits(min_batch=4, max_batch=14, target=16), ControlState(batch=8), "ok", CFG,
               latest_peak=2 * GB, latest_batch=8)
    assert (d.plan.batch_size, d.plan.grad_accum_steps, d.plan.effective_batch_size) == (8, 2, 16)
    tiny = pool(free=0, own=0, margin=0)
    d = decide(curve, tiny, Limits(min_batch=4), ControlState(batch=8), "ok", CFG, latest_peak=2 * GB, latest_batch=8)
    assert d.plan.batch_size == 4 and "min_batch" in d.plan.reason


def test_workers_follow_measured_cost_and_seed_table():
    curve = Curve(GB, 0.1 * GB, "fit", 3, 1.0)
    shared = Pool("host", "unified", 128 * GB, 20 * GB, 30 * GB, GB)
    d = decide(curve, shared, Limits(num_workers=8), ControlState(batch=8), "ok", CFG, latest_peak=10 * GB,
               latest_batch=8, workers=WorkerFacts(uss=(4 * GB, 4 * GB)), host_total_bytes=128 * GB)
    # 29 GB of budget beside two live 4 GB workers; with no worker the pool would allow 360.
    # Workers asked for keep their cost while the batch left is at least half that: 4 of 8.
    alone = curve.max_batch(29 * GB + 8 * GB)
    assert d.plan.num_workers == 4 and d.plan.prefetch_factor == 1  # memory-bound: fewer batches in flight too
    assert alone // 2 <= d.plan.batch_size < alone and curve.max_batch(37 * GB - 5 * 4 * GB) < alone // 2
    assert "4 of the 8 workers asked for, at 3.73 GiB each, beside the batch" in d.plan.reason, d.plan.reason
    assert d.budget_bytes == 37 * GB - 4 * 4 * GB  # the batch's budget: the pool less the kept workers
    # The hint is the client's number: an absurd one is answered with what the pool affords, at once.
    absurd = decide(curve, shared, Limits(num_workers=10 ** 12), ControlState(batch=8), "ok", CFG, latest_peak=10 * GB,
                    latest_batch=8, workers=WorkerFacts(uss=(4 * GB, 4 * GB)), host_total_bytes=128 * GB)
    assert (absurd.plan.num_workers, absurd.plan.batch_size) == (4, d.plan.batch_size)
    # A job that asked for no count is not told it asked for one: the 8 are one per CPU it may use.
    unasked = decide(curve, shared, Limits(), ControlState(batch=8), "ok", CFG, latest_peak=10 * GB, latest_batch=8,
                     workers=WorkerFacts(uss=(4 * GB, 4 * GB), cpus=8.0), host_total_bytes=128 * GB)
    assert "4 of the 8 workers for its CPUs, at 3.73 GiB each" in unasked.plan.reason, unasked.plan.reason
    roomy = decide(curve, shared, Limits(num_workers=2, prefetch_factor=4), ControlState(batch=8), "ok", CFG,
                   latest_peak=10 * GB, latest_batch=8, workers=WorkerFacts(uss=(GB, GB)), host_total_bytes=128 * GB)
    assert (roomy.plan.num_workers, roomy.plan.prefetch_factor) == (2, 4)  # room: the job's own choice
    unmeasured = decide(curve, shared, Limits(num_workers=8), ControlState(batch=8), "ok", CFG,
                        host_total_bytes=100 * GB)
    assert unmeasured.plan.num_workers == 2  # 64-127 GB of unified memory: 2 workers (seed 000)
    high = decide(curve, shared, Limits(num_workers=4, prefetch_factor=4), ControlState(batch=8), "high", CFG,
                  host_total_bytes=256 * GB)
    assert (high.plan.num_workers, high.plan.prefetch_factor) == (2, 1)


def test_worker_cpus_are_shared_among_the_nodes_ranks_once():
    """Two ranks on a node: the job read's CPUs (the trainer's affinity within its quota) are
    halved; the client's own count, sent before any read, was halved by the client already."""
    from memd.planner import worker_facts
    from memd.sampling.snapshot import JobMemory, ProcessMemory
    from memd.sessions import SessionRecord

    session = SessionRecord(token="t", sid=1, job="j", pid=7, host="h", local=True, start_time=None, limits=Limits(),
                      created=0.0, last_seen=0.0, cpus=4.0, local_world_size=2)
    assert worker_facts(session, None, PolicyConfig()).cpus == 4.0
    job = JobMemory(pid=7, processes=(ProcessMemory(7, 1, "trainer", 1, None, None),), cgroup=None, errors=(),
                    monotonic=1.0, cpus=8.0)
    assert worker_facts(session, job, PolicyConfig()).cpus == 4.0


def test_a_worker_has_levelled_off_only_when_it_worked_and_grew_little_for_it():
    from memd.policy.growth import growth

    MiB = 2 ** 20
    growing = [(0.0, 1.0, 100 * MiB), (2.0, 2.0, 120 * MiB), (4.0, 3.0, 140 * MiB)]
    course = growth(growing, 600 * MiB, 30.0)
    assert not course.levelled and course.rate == 10 * MiB and course.projected == 440 * MiB
    assert growth(growing, 300 * MiB, 30.0).projected == 300 * MiB  # never past its anonymous pages
    paused = [(0.0, 5.0, 300 * MiB), (2.0, 5.0, 300 * MiB), (4.0, 5.01, 300 * MiB)]
    assert not growth(paused, 600 * MiB, 30.0).levelled  # no work done: it may resume copying
    done = [(0.0, 5.0, 330 * MiB), (2.0, 5.2, 330 * MiB), (4.0, 5.4, 330 * MiB + 2 ** 19)]  # +3.75 MiB in 30 s
    assert growth(done, 600 * MiB, 30.0).levelled
    assert not growth(done[:2], 600 * MiB, 30.0).levelled  # two reads say too little
    unknown = [(t, None, b) for t, _, b in done]  # no CPU time (not Linux): never taken as levelled
    assert not growth(unknown, 600 * MiB, 30.0).levelled

"""One job identity, known at hello and used both to look a learned curve up and to save it:
the job's own cgroup (read at hello from a fixture /proc) and the GPU it names. No daemon."""
import dataclasses
import os

from memd import ops
from memd.config import Config, PolicyConfig
from memd.core import Core
from memd.planner import identify, plan_session
from memd.policy.controller import FIRST_BATCH, ControlState, Limits
from memd.policy.fit import Observation
from memd.sampling.snapshot import CPU, DISCRETE, Gpu, GpuProcess, JobMemory, ProcessMemory, Snapshot, SystemMemory
from memd.sessions import SessionRecord, Sessions
from memd.state import StateStore

GB = 10 ** 9
MB = 10 ** 6
PID = 4242
CFG = PolicyConfig()


def write(root, rel, text):
    path = os.path.join(str(root), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def proc_with_job_in_cgroup(root, limit):
    """A fixture /proc where PID lives in a v1 memory cgroup of ``limit`` bytes (1 GB in use)."""
    write(root, "proc/self/mountinfo",
          "35 31 0:32 / %s/sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n" % root)
    write(root, "proc/%d/cgroup" % PID, "4:memory:/slurm/job42\n0::/\n")
    write(root, "proc/%d/stat" % PID, "%d (python) S 1 " % PID + " ".join(["0"] * 18) + " 777 0\n")
    d = "sys/fs/cgroup/memory/slurm/job42/"
    write(root, d + "memory.limit_in_bytes", "%d\n" % limit)
    write(root, d + "memory.usage_in_bytes", "%d\n" % GB)
    write(root, d + "memory.stat", "hierarchical_memory_limit %d\ntotal_inactive_file 0\n" % limit)
    return str(root) + "/proc"


def host_core(tmp_path, proc_root):
    """A 64 GB host with no GPU, the job's pid local to it; the job's tree not read yet."""
    core = Core(config=Config(), sessions=Sessions(8, 60.0, lambda: 0.0, lambda s: True),
                store=StateStore(str(tmp_path / "state")), clock=lambda: 0.0, proc_root=proc_root, host="here")
    core.snapshot = Snapshot(taken_at=0.0, monotonic=0.0, host="here", memory_model=CPU,
                             system=SystemMemory(64 * GB, 60 * GB, 4 * GB, 0, 0), pressure=None, cgroup=None)
    return core


def run(core, reports):
    token = ops.hello(core, dict(job="bounded", pid=PID, host="here", max_batch=100000))
    for batch in reports:
        ops.report(core, {"token": token["token"], "batch_size": batch, "peak_bytes": 200 * MB + batch * 10 * MB})
    return token


def test_a_job_in_a_cgroup_smaller_than_the_host_finds_what_it_learned(tmp_path):
    """The issue's case: an 8 GB cgroup on a 64 GB host. Looked up at hello as cpu:59 (the host,
    its cgroup not known yet) and saved as cpu:7 (its cgroup, from a later sample), the curve
    was never found again."""
    core = host_core(tmp_path, proc_with_job_in_cgroup(tmp_path, 8 * GB))
    first = run(core, (8, 8, 8, 16, 16))
    session = next(iter(core.sessions))
    # Its cgroup's 7 GiB, and its configuration (max_batch) after the "#"
    assert session.pool_key.startswith("cpu:7#") and session.cgroup.limit_bytes == 8 * GB
    assert first["plan"]["batch_size"] == FIRST_BATCH and "no reports yet" in first["plan"]["reason"]  # nothing known
    ops.bye(core, {"token": first["token"]})
    assert core.store.recall("bounded", session.pool_key) is not None
    again = run(core, ())
    plan = again["plan"]
    # Its first plan starts from its curve, within its cgroup: the largest batch its first run
    # ran (the curve allows about 680 in the group's 7 GB left), never memd's first batch nor
    # anything from the host's 60 GB.
    assert plan["batch_size"] == 16 and "from earlier runs of this job" in plan["reason"], plan
    assert core.sessions.get(again["token"]).remembered


def test_a_job_whose_cgroup_cannot_be_read_is_held_until_it_is(tmp_path):
    """No cgroup known at hello (unreadable): the first plan with a curve holds, as before,
    rather than budget the job from the machine's RAM."""
    root = proc_with_job_in_cgroup(tmp_path, 8 * GB)
    os.remove(os.path.join(root, str(PID), "cgroup"))
    core = host_core(tmp_path, root)
    token = ops.hello(core, dict(job="j", pid=PID, host="here", hints={"fixed_bytes": GB, "per_sample_bytes": MB}))
    assert core.sessions.get(token["token"]).cgroup is None and core.sample_errors["cgroup"] == 1
    assert "has not been read yet" in token["plan"]["reason"]
    assert core.sessions.get(token["token"]).pool_key.startswith("cpu:59#")  # the host's, as the daemon sees it


def gpu(index, uuid, name="H100", total=80 * GB, pids=()):
    return Gpu(index, uuid, name, total, 10 * GB, total - 10 * GB, 0, False,
               processes=tuple(GpuProcess(p, GB) for p in pids))


def gpu_snapshot(*gpus):
    return Snapshot(taken_at=0.0, monotonic=0.0, host="h", memory_model=DISCRETE,
                    system=SystemMemory(1000 * GB, 900 * GB, 100 * GB, 0, 0), pressure=None, cgroup=None, gpus=gpus)


def session(**fields):
    fields.setdefault("limits", Limits())
    fields.setdefault("local", True)
    return SessionRecord(token="t", sid=1, job="j", pid=PID, host="h", start_time=None,
                   created=0.0, last_seen=0.0, **fields)


def test_a_gpu_job_is_keyed_by_the_gpu_it_names_or_any_when_all_are_alike():
    alike = gpu_snapshot(gpu(0, "GPU-a"), gpu(1, "GPU-b"))
    mixed = gpu_snapshot(gpu(0, "GPU-a"), gpu(1, "GPU-c", "A100", 40 * GB))
    assert identify(session(device_uuid="GPU-c"), mixed, CFG) == "gpu:A100:%d" % (40 * GB)
    assert identify(session(device="cuda:0", visible_devices="1"), mixed, CFG) == "gpu:A100:%d" % (40 * GB)
    assert identify(session(), alike, CFG) == "gpu:H100:%d" % (80 * GB)  # whichever it is: the same kind
    assert identify(session(), mixed, CFG) is None  # cannot tell yet
    using = gpu_snapshot(gpu(0, "GPU-a"), gpu(1, "GPU-c", "A100", 40 * GB, pids=(PID,)))
    assert identify(session(), using, CFG) == "gpu:A100:%d" % (40 * GB)  # its process is on it already


def test_a_gpu_unknown_at_hello_is_keyed_by_the_gpu_it_is_first_seen_on():
    s = session()
    mixed = gpu_snapshot(gpu(0, "GPU-a"), gpu(1, "GPU-c", "A100", 40 * GB))
    s.pool_key = identify(s, mixed, CFG)
    plan_session(s, mixed, "ok", [s], {}, CFG)
    assert s.pool_key is None  # planned from no GPU: still unknown
    seen = gpu_snapshot(gpu(0, "GPU-a"), gpu(1, "GPU-c", "A100", 40 * GB, pids=(PID,)))
    job = JobMemory(PID, (ProcessMemory(PID, 1, "python", GB, GB, GB),), None, (), 0.0)
    plan_session(s, seen, "ok", [s], {PID: job}, CFG)
    assert s.pool_key == "gpu:A100:%d" % (40 * GB)
    plan_session(s, gpu_snapshot(gpu(0, "GPU-a", pids=(PID,)), gpu(1, "GPU-c", "A100", 40 * GB)), "ok", [s],
                 {PID: job}, CFG)
    assert s.pool_key == "gpu:A100:%d" % (40 * GB)  # kept: one key per session


def test_a_gpu_job_whose_gpu_is_not_known_yet_is_not_planned_from_host_ram():
    """Its cgroup read at hello bounds a host job's first plan; on a machine with GPUs a host
    pool only means the job's GPU is unknown, and its remembered curve (GPU bytes) must not be
    budgeted from the host's 900 GB: the plan holds at its default until its GPU is known,
    and says so; its job read changes nothing."""
    from memd.sampling.snapshot import Cgroup

    s = session(cgroup=Cgroup(1, "/", None, GB), limits=Limits(default_batch=8))
    s.remembered = [Observation(8, 10 * GB), Observation(16, 18 * GB)]
    mixed = gpu_snapshot(gpu(0, "GPU-a"), gpu(1, "GPU-c", "A100", 40 * GB))
    plan = plan_session(s, mixed, "ok", [s], {}, CFG).plan
    assert plan.batch_size == 8 and "which GPU this job runs on is not known yet" in plan.reason, plan
    job = JobMemory(PID, (ProcessMemory(PID, 1, "python", GB, GB, GB),), None, (), 0.0)
    plan = plan_session(s, mixed, "ok", [s], {PID: job}, CFG).plan
    assert plan.batch_size == 8 and "which GPU this job runs on is not known yet" in plan.reason, plan
    assert s.pool is None  # so its peaks are not measured from host RAM meanwhile (ops.watch.measure_peak)


def test_runs_of_another_configuration_are_learned_apart():
    """Model hints and max/target batch are part of the key (after "#"); how the data is loaded
    (num_workers, prefetch_factor) is not, nor is the order the hints come in."""
    from memd.planner import configuration

    plain = session()
    assert configuration(plain) == ""  # a job that says only its name: the pool key alone
    small = session(hints={"params": 124_000_000, "layers": 12, "num_workers": 4})
    same = session(hints={"layers": 12, "params": 124_000_000, "num_workers": 8, "prefetch_factor": 4})
    large = session(hints={"params": 355_000_000, "layers": 24})
    capped = session(hints={"params": 124_000_000, "layers": 12}, limits=Limits(max_batch=64))
    keys = {configuration(s) for s in (small, large, capped)}
    assert configuration(small) == configuration(same) and len(keys) == 3 and all(k.startswith("#") for k in keys)
    assert configuration(session(limits=Limits(target=256))) != configuration(session(limits=Limits(max_batch=256)))


def test_a_cpu_job_on_a_machine_with_gpus_is_planned_from_host_ram():
    """device="cpu" says where it runs: its host pool is its pool, keyed and budgeted as such."""
    s = session(device="cpu", limits=Limits(default_batch=8), cgroup=None, local=False)
    s.remembered = [Observation(8, 8 * GB), Observation(16, 12 * GB)]
    mixed = gpu_snapshot(gpu(0, "GPU-a"), gpu(1, "GPU-c", "A100", 40 * GB))
    assert identify(s, mixed, CFG) == "discrete:931"  # the host RAM, in GiB
    plan = plan_session(s, mixed, "ok", [s], {}, CFG).plan
    assert plan.batch_size == 16 and "from earlier runs of this job" in plan.reason, plan


def test_an_oom_ceiling_is_re_tried_after_three_clean_runs_held_at_it(tmp_path):
    """Run 1 runs out of memory above 64: its ceiling, one below, is remembered. Runs 2-4 start
    at the batch they ran, grow back to the ceiling and go clean there: each is counted (memd curves shows
    it). After the third the ceiling is lifted, and run 5 grows past 63 to what its curve
    allows. Its peaks are reported (a fixture /proc, a job read of 1 GB)."""
    (tmp_path / "proc" / str(PID)).mkdir(parents=True)
    core = host_core(tmp_path, str(tmp_path / "proc"))
    core.jobs = {PID: JobMemory(PID, (ProcessMemory(PID, 1, "python", GB, GB, GB),), None, (), 0.0)}

    def run_job(steps, oom_at=None):
        reply = ops.hello(core, dict(job="ft", pid=PID, host="here"))
        token, plan, batches = reply["token"], reply["plan"], []
        for _ in range(steps):
            batch = plan["batch_size"]
            batches.append(batch)
            if oom_at is not None and batch >= oom_at:
                plan = ops.oom(core, {"token": token, "batch_size": batch})["plan"]
                oom_at = None
                continue
            plan = ops.report(core, {"token": token, "batch_size": batch, "peak_bytes": GB + batch * 50 * MB})["plan"]
            # a sample of the machine each step (a step that went as planned is decided on at the next one)
            core.snapshot = dataclasses.replace(core.snapshot, monotonic=core.snapshot.monotonic + 1)
        key = core.sessions.get(token).pool_key
        ops.bye(core, {"token": token})
        assert key == "cpu:59@uid:%d" % os.stat(tmp_path / "proc" / str(PID)).st_uid  # its pool, its owner
        return batches, core.store.recall("ft", key)

    batches, memory = run_job(40, oom_at=64)
    ceiling = next(b for b in batches if b >= 64) - 1
    assert memory.ceiling == ceiling and memory.clean_runs == 0, (batches, memory)
    for clean in (1, 2):
        batches, memory = run_job(60)
        assert max(batches) == ceiling and memory.ceiling == ceiling and memory.clean_runs == clean, (batches, memory)
    batches, memory = run_job(60)
    assert max(batches) == ceiling and memory.ceiling is None and memory.clean_runs == 0  # lifted
    batches, memory = run_job(60)
    assert max(batches) > ceiling, batches  # the curve's room (about 1100 in 60 GB) is tried again


def test_a_job_at_its_planned_peak_in_its_own_cgroup_is_not_critical(tmp_path):
    """A plan takes the job's cgroup to its margin (1 %) at a step's peak: a read there (1.2 % free)
    is the plan working, not critical pressure (which cut a job at its plan by a quarter, again
    and again); below half the margin (0.4 % free) the group is fuller than planned: critical."""
    from memd.sampling.snapshot import Cgroup

    limit = 8 * 2 ** 30

    def plan_at(free_share):
        s = session(limits=Limits(default_batch=9000))
        s.observations = [Observation(b, int(0.35 * GB + b * 0.8 * MB)) for b in (4000, 4000, 8000, 8000, 9000, 9000)]
        s.state = ControlState(batch=9000)
        s.latest_peak, s.latest_batch = s.observations[-1].peak_bytes, 9000
        usage = int(limit * (1 - free_share))
        job = JobMemory(PID, (ProcessMemory(PID, 1, "python", usage, usage, usage),), Cgroup(1, "/j", limit, usage),
                        (), 0.0, trainer_rss_bytes=usage)
        snap = Snapshot(taken_at=0.0, monotonic=0.0, host="h", memory_model="cpu",
                        system=SystemMemory(64 * GB, 60 * GB, 4 * GB, 0, 0), pressure=None, cgroup=None)
        return plan_session(s, snap, "ok", [s], {PID: job}, CFG).plan

    at_peak = plan_at(0.012)
    assert at_peak.pressure == "ok" and "critical" not in at_peak.reason, at_peak
    fuller = plan_at(0.004)
    assert fuller.pressure == "critical" and fuller.throttle and fuller.batch_size < 9000, fuller

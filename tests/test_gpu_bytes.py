"""One rule for a job's GPU bytes (snapshot.gpu_bytes): the sampler's per-process sums, the
budget's "what the job holds on its GPU" and the peak the daemon measures for a report all add
GPU memory up the same way, unknown when any part is. Pure functions and a Core with no daemon."""
from memd.config import Config
from memd.core import Core
from memd.ops import watch
from memd.policy import budget
from memd.policy.controller import Limits
from memd.sampling import snapshot as snap
from memd.sampling.sampler import gpu_bytes_by_pid
from memd.sampling.snapshot import DISCRETE, Gpu, GpuProcess, JobMemory, ProcessMemory, Snapshot, SystemMemory
from memd.sessions import SessionRecord, Sessions
from memd.state import StateStore

GiB = 1 << 30
TRAINER, WORKER, STRANGER = 7, 8, 9


def device(*processes):
    return Gpu(0, "GPU-0", "L4", 24 * GiB, 10 * GiB, 14 * GiB, 0, False,
               processes=tuple(GpuProcess(pid, used) for pid, used in processes))


JOB = JobMemory(TRAINER, (ProcessMemory(TRAINER, 1, "python", GiB, GiB, GiB),
                          ProcessMemory(WORKER, TRAINER, "python", GiB, GiB, GiB)), None, (), 0.0)


def test_the_rule_sums_what_is_known_and_is_unknown_when_any_part_is():
    procs = (GpuProcess(TRAINER, 3 * GiB), GpuProcess(WORKER, 0), GpuProcess(STRANGER, None))
    assert snap.gpu_bytes(procs) is None  # the stranger's use is unknown: so is the whole
    assert snap.gpu_bytes(procs, {TRAINER, WORKER}) == 3 * GiB  # zero is known, not unknown
    assert snap.gpu_bytes(procs, {TRAINER, STRANGER}) is None
    assert snap.gpu_bytes(procs, {42}) is None  # none of them on it (NVML shows no pid of another namespace)
    assert snap.gpu_bytes(()) is None


def test_the_samplers_sum_over_devices_follows_it():
    gpus = [device((TRAINER, 2 * GiB), (WORKER, None)), device((TRAINER, GiB), (WORKER, GiB))]
    assert gpu_bytes_by_pid(gpus) == {TRAINER: 3 * GiB, WORKER: None}


def test_the_budget_and_the_measured_peak_agree_on_a_job_with_a_process_nvml_does_not_measure(tmp_path):
    """The budget once summed only the known parts: a job whose worker's use NVML did not say
    was taken to hold its trainer's share alone, the rest counted as another's."""
    partly = device((TRAINER, 3 * GiB), (WORKER, None), (STRANGER, 5 * GiB))
    fully = device((TRAINER, 3 * GiB), (WORKER, GiB), (STRANGER, None))
    assert budget.gpu_pool(partly, JOB, Config().policy).own_bytes is None
    assert budget.gpu_pool(fully, JOB, Config().policy).own_bytes == 4 * GiB  # a stranger's unknown is not the job's

    core = Core(config=Config(), sessions=Sessions(4, 60.0, lambda: 0.0, lambda s: True),
                store=StateStore(str(tmp_path / "state")), clock=lambda: 0.0, host="here", proc_root=str(tmp_path))
    session = SessionRecord(token="t", sid=1, job="j", pid=TRAINER, host="here", local=True, start_time=None,
                            limits=Limits(), created=0.0, last_seen=0.0, pool="GPU-0")
    core.jobs = {TRAINER: JOB}
    for gpu, peak in ((partly, None), (fully, 4 * GiB)):
        core.snapshot = Snapshot(taken_at=0.0, monotonic=0.0, host="here", memory_model=DISCRETE,
                                 system=SystemMemory(64 * GiB, 48 * GiB, 16 * GiB, 0, 0), pressure=None, cgroup=None,
                                 gpus=(gpu,))
        assert watch.measure_peak(core, session) == peak

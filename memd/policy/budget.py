"""How much memory a job's peak may reach: the pool it draws on and what is left in it.

discrete:     the job's GPU (matched by UUID): device total minus what others use.
unified, cpu: one pool for everything: min(host RAM, the job's cgroup limit), minus every
              other process, the job's own dataloader workers included.
In both, the job may grow to what it holds now (in the units it reports) plus what is free,
minus a margin and minus the growth already promised to other sessions in the pool.

What is held back depends on who owns the pool. The machine's RAM keeps an OS reserve (the
OS and the desktop live there); a job's own cgroup has no OS in it, so its room is the limit
minus what the group cannot give back (page cache is reclaimed before a kill: cgroup.py).
The margin is small: the learned curve already carries the spread of this job's own peaks,
so the margin only covers what no report shows (kernel memory, others' growth between samples).

Whatever the reads say, a budget never passes the pool's bound: its limit (the group's, the
host's RAM less the OS reserve, the device's total) less the margin and less what the pool's
other sessions claim (their planned peaks). Free and held are counted in one unit, what the pool
counts as in use (a group's usage less its page cache; the host's MemTotal less MemAvailable;
a device's used memory): a process's file-mapped pages are page cache, free to the pool, so the
job holds its resident set less them (JobMemory.trainer_held_bytes), and its measured peaks are
counted the same way (procs.read_peak). tests/test_budget_units.py pins both on real processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from memd.config import PolicyConfig
from memd.policy.frozen import evolve
from memd.sampling.snapshot import DISCRETE, Cgroup, Gpu, JobMemory, Snapshot, gpu_bytes

HOST = "host"


@dataclass(frozen=True)
class Pool:
    name: str  # HOST, or the GPU's uuid
    kind: str  # the snapshot's memory model ("discrete" only for a GPU pool)
    capacity_bytes: int
    free_bytes: int  # capacity minus everything in use now
    own_bytes: Optional[int]  # what the job holds in this pool now; None when unknown
    margin_bytes: int
    reserved_bytes: int = 0  # growth promised to other sessions sharing the pool
    share_bytes: Optional[int] = None  # at most this much when others want the pool too (fair_share)
    # The part of the margin no page needs now: in a job's own cgroup, room kept for file pages
    # the group mapped earlier in the run and maps no longer (group_spare). A step running into it
    # costs no mapped page and no kill; only a cut worth its rebuild goes for it (controller).
    spare_bytes: int = 0
    # The most the pool's jobs may hold together: capacity less what the OS keeps there (the host's
    # reserve; a group or a device keeps none). None: the capacity.
    limit_bytes: Optional[int] = None
    claimed_bytes: int = 0  # what the pool's other sessions claim: their planned peaks (claims.py)

    @property
    def bound_bytes(self) -> int:
        """The largest budget this pool can give: its limit less the margin and the others' claims."""
        limit = self.capacity_bytes if self.limit_bytes is None else self.limit_bytes
        return max(0, limit - self.margin_bytes - self.claimed_bytes)

    @property
    def in_use_bytes(self) -> int:
        """What the pool has in use now, everyone's (its limit less what is free)."""
        limit = self.capacity_bytes if self.limit_bytes is None else self.limit_bytes
        return max(0, limit - self.free_bytes)

    def budget(self, held_peak: Optional[int]) -> int:
        """The largest peak (in the job's reported units) that still fits.

        The job holds ``own`` in the pool (as measured); reports may leave part of it out (the
        CUDA context, the Python heap), and ``min(own, held_peak)`` counts only the part its
        reports include. When ``own`` is unknown the job is taken to hold ``held_peak``, the
        largest peak it reported (PyTorch's caching allocator keeps what it reserved).
        """
        if self.own_bytes is None:
            # Unmeasured, the job cannot hold more than the pool has in use.
            held = min(held_peak or 0, max(0, self.capacity_bytes - self.free_bytes))
        elif held_peak is None:
            held = self.own_bytes
        else:
            held = min(self.own_bytes, held_peak)
        greedy = max(0, min(self.free_bytes + held - self.margin_bytes - self.reserved_bytes, self.bound_bytes))
        return greedy if self.share_bytes is None else min(greedy, max(self.share_bytes, held))

    def with_reserved(self, reserved_bytes: int) -> "Pool":
        return evolve(self, reserved_bytes=max(0, reserved_bytes))

    def with_share(self, share_bytes: Optional[int]) -> "Pool":
        return evolve(self, share_bytes=share_bytes)

    def with_claimed(self, claimed_bytes: int) -> "Pool":
        return evolve(self, claimed_bytes=max(0, claimed_bytes))


def fair_share(room: int, own_held: int, others: Sequence[Tuple[int, Optional[int]]]) -> int:
    """What one session may plan for when others share its pool: max-min fairness.

    ``room`` is what the sessions could hold together; ``others`` lists each other session's
    (held now, peak it would plan for alone; None before it knows). Each is left what it
    holds and up to an equal share of what it wants (an equal share when it does not know
    yet), so the first job to learn its curve cannot take the whole device from a second one
    that started with it; a job that wants little leaves the rest to the others.
    """
    return share_beside(room, own_held, len(others), lambda equal: sum(
        max(held, equal if wanted is None else min(wanted, equal)) for held, wanted in others))


def share_beside(room: int, own_held: int, number: int, kept: Callable[[int], int]) -> int:
    """fair_share, given the ``number`` of other sessions and ``kept(equal)``, what they keep at
    an equal share ``equal`` (the daemon reads it from sorted claims: memd.claims)."""
    return max(own_held, room - kept(room // (number + 1)))


def rise_within(reads: Sequence[Tuple[float, int]], window: float) -> int:
    """The most ``reads`` (time, bytes), oldest first, rose within any ``window`` seconds: what a
    neighbour that grew so lately may add again before a plan can answer it (planner.growth_ahead).
    A fall is no rise: a neighbour that shrinks holds nothing back."""
    rise, start = 0, 0
    for i, (at, value) in enumerate(reads):
        while start < i and reads[start][0] < at - window:
            start += 1
        low = min(v for _, v in reads[start:i + 1])
        rise = max(rise, value - low)
    return rise


def margin(capacity: int, cfg: PolicyConfig) -> int:
    return max(int(capacity * cfg.margin_ratio), cfg.margin_min_bytes)


def os_reserve(host_total: int, cfg: PolicyConfig) -> int:
    """What the OS keeps of the machine's RAM (seed 000's 8 GB, at most a share of the RAM)."""
    return min(cfg.os_reserve_bytes, int(cfg.os_reserve_max_ratio * host_total))


def host_free(total: int, available: int, cfg: PolicyConfig) -> int:
    """The machine's available RAM less the OS reserve: what jobs may take of it."""
    return max(0, available - os_reserve(total, cfg))


def find_gpu(gpus: Sequence[Gpu], device_uuid: Optional[str] = None, device: Optional[str] = None,
             visible: Optional[str] = None, pids: Sequence[int] = ()) -> Optional[Gpu]:
    """The job's GPU: by UUID; else through CUDA_VISIBLE_DEVICES and the CUDA index; else the GPU
    its processes use; else the only GPU there is. CUDA and NVML indices differ, so an index
    alone is trusted only when nothing else is known."""
    healthy = [g for g in gpus if g.healthy or g.uuid]
    if device_uuid:
        want = _bare_uuid(device_uuid)
        for gpu in healthy:
            if gpu.uuid is not None and _bare_uuid(gpu.uuid) == want:
                return gpu
    index = _cuda_index(device)
    if index is not None and visible:
        entries = [v.strip() for v in visible.split(",") if v.strip()]
        if index < len(entries):
            entry = entries[index]
            for gpu in healthy:
                if _digits(entry) and gpu.index == int(entry) and gpu.mig_parent_uuid is None:
                    return gpu
                if not _digits(entry) and gpu.uuid is not None and _bare_uuid(gpu.uuid).startswith(_bare_uuid(entry)):
                    return gpu
    pid_set = set(pids)
    for gpu in healthy:
        if any(p.pid in pid_set for p in gpu.processes):
            return gpu
    if index is not None and not visible:
        for gpu in healthy:
            if gpu.index == index and gpu.mig_parent_uuid is None:
                return gpu
    return healthy[0] if len(healthy) == 1 else None


def gpu_pool(gpu: Gpu, job: Optional[JobMemory], cfg: PolicyConfig) -> Optional[Pool]:
    """The job's GPU as a pool. What the job holds there is its processes' use (snapshot.gpu_bytes):
    unknown when any of them does not say, so the job is taken to hold its reported peak (Pool.budget);
    the known part alone counted the rest of its own memory as another's."""
    if gpu.total_bytes is None or gpu.used_bytes is None or not gpu.healthy or gpu.uuid is None:
        return None  # a healthy GPU has its uuid: NVML gave it before its memory
    free = gpu.free_bytes if gpu.free_bytes is not None else gpu.total_bytes - gpu.used_bytes
    own = gpu_bytes(gpu.processes, set(job_pids(job))) if job is not None else None
    return Pool(gpu.uuid, DISCRETE, gpu.total_bytes, max(0, free), own, margin(gpu.total_bytes, cfg))


def host_pool(snapshot: Snapshot, job: Optional[JobMemory], cfg: PolicyConfig,
              cgroup: Optional[Cgroup] = None, mapped_file_bytes: Optional[int] = None,
              resident: bool = False) -> Pool:
    """The host pool as the job sees it: bounded by its own cgroup when that is smaller (the
    latest job read's; ``cgroup``, the one read when the job said hello, until a job read has
    one; else the container's). ``mapped_file_bytes``: the most file pages that group has kept
    mapped (group_margin); by default what it maps now.

    What the job holds is the trainer's own resident set less its file pages, read with its
    cgroup's usage and the host's MemAvailable in one pass (Sampler.job), so free and held
    describe the same instant and the same units as its measured peaks (procs.read_peak); its
    workers' memory stays with the others, in use. ``resident``: the job reports its own peaks,
    taken to count its resident set (VmHWM, psutil's RSS), file pages included; the pool is
    then counted in those units: the trainer holds its whole resident set, and the limit is
    the pool's plus the file pages it maps (in its peaks, yet free to the pool).
    """
    cg = job.cgroup if job is not None and job.cgroup is not None else cgroup or container_cgroup(snapshot)
    total = snapshot.system.total_bytes
    # The host's free memory as read with the trainer's (Sampler._paired), else the snapshot's.
    available = job.available_bytes if job is not None and job.available_bytes is not None else \
        snapshot.system.available_bytes
    capacity, free = bounded_by(cg, total, host_free(total, available, cfg))
    own = job.trainer_held_bytes if job is not None else None
    limit = min(capacity, total - os_reserve(total, cfg))
    if resident and job is not None and job.trainer_rss_bytes is not None:
        own = job.trainer_rss_bytes
        limit += job.trainer_file_bytes or 0
    spare = 0
    if capacity < total and cg is not None:  # the group's limit binds: a pool with no OS and no other job in it
        held_back = group_margin(capacity, cg.mapped_file_bytes if mapped_file_bytes is None else mapped_file_bytes,
                                 cfg)
        spare = group_spare(held_back, cg.mapped_file_bytes, cfg)
    else:
        held_back = margin(capacity, cfg)
    return Pool(HOST, snapshot.memory_model, capacity, free, own, held_back, spare_bytes=spare, limit_bytes=limit)


def group_margin(capacity: int, mapped_file: Optional[int], cfg: PolicyConfig) -> int:
    """The margin in a cgroup that bounds the job: room for the file pages the group keeps mapped,
    up to the usual margin, and never less than margin_min_bytes (kernel memory).

    The group's page cache counts as free (the kernel reclaims it before it kills), but the pages
    its running code maps come back as faults: with the libraries charged to the job's group, the
    two-workers job ran at full speed at 632 with 16 MiB of them mapped, and at 648 its group kept
    4 MiB of file pages and the job ran at 0.40 of its speed, 513 major faults a step
    (docs/results.md). Charged to another group (a shared virtualenv read before), they are not
    this group's to lose, and the 1 % margin, 20 MiB of 2 GiB, held back 18 samples beside four
    workers where 95 % of the batch that fits is 7 MiB below the kill line. What no read shows is
    kernel memory: the four-workers job's rose 6.8 MiB (9.1 to 15.9) as its loader forked four
    new workers beside the old ones. Unknown mapped pages keep the usual margin."""
    usual = margin(capacity, cfg)
    return usual if mapped_file is None else max(cfg.margin_min_bytes, min(mapped_file, usual))


def group_spare(held_back: int, mapped_now: Optional[int], cfg: PolicyConfig) -> int:
    """What of a group's margin neither kernel memory (margin_min_bytes) nor the file pages it maps
    now need: the margin keeps room for the most it mapped this run (a rebuilt loader's fresh
    workers map their code for a moment), and the four-workers job mapped 5-10 MiB where that
    most was 10-16. Unknown mapped pages spare nothing."""
    return 0 if mapped_now is None else max(0, held_back - max(cfg.margin_min_bytes, mapped_now))


def bounded_by(cg: Optional[Cgroup], capacity: int, free: int) -> Tuple[int, int]:
    """(capacity, free) of host memory as seen from inside ``cg``: its limit, when smaller, is
    the capacity, and what the group may still take (its limit minus what it cannot give back)
    bounds the free bytes."""
    if cg is None or cg.limit_bytes is None or cg.limit_bytes >= capacity:
        return capacity, free
    return cg.limit_bytes, min(free, max(0, cg.limit_bytes - unreclaimable(cg)))


def unreclaimable(cg: Cgroup) -> int:
    """What the group holds that the kernel cannot take back before killing: usage minus the
    page cache it reclaims first (working set, as cAdvisor, when that is not reported)."""
    if cg.reclaimable_bytes is not None and cg.usage_bytes is not None:
        return max(0, cg.usage_bytes - cg.reclaimable_bytes)
    return cg.working_set_bytes if cg.working_set_bytes is not None else (cg.usage_bytes or 0)


def container_cgroup(snapshot: Snapshot) -> Optional[Cgroup]:
    """The daemon's cgroup when it bounds every job here too, else None.

    At the root of its cgroup namespace (path "/") the daemon sees its container's cgroup,
    whose limit binds everything in the container. Anywhere else (memd.service under systemd)
    the cgroup is the daemon's own: its MemoryMax says nothing about the jobs'.
    """
    cg = snapshot.cgroup
    return cg if cg is not None and cg.path == "/" else None


def job_pids(job: JobMemory) -> Sequence[int]:
    return [p.pid for p in job.processes]


def _bare_uuid(uuid: str) -> str:
    uuid = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix):]
    return uuid


def _cuda_index(device: Optional[str]) -> Optional[int]:
    if device is None:
        return None
    text = str(device).strip().lower()
    if text.startswith("cuda:"):
        text = text[5:]
    return int(text) if _digits(text) else None


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit() is true of "²", which int() refuses (a hello naming
    device "cuda:²" raised ValueError on a machine with GPUs: `internal`, and a session opened
    whose token its client never got)."""
    return text.isascii() and text.isdigit()

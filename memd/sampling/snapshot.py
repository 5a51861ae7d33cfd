"""What the machine looked like at one instant: small frozen records in base units.

``None`` always means "unknown" (not measurable here, or the read failed); it is never zero and
never a string. Everything downstream (policy, metrics, the CLI) reads only these records.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Container, Dict, Iterable, List, Optional, Tuple

DISCRETE = "discrete"
UNIFIED = "unified"
CPU = "cpu"


@dataclass(frozen=True)
class SystemMemory:
    total_bytes: int
    available_bytes: int  # MemAvailable: what can be allocated without swapping (never MemFree)
    used_bytes: int
    swap_total_bytes: int
    swap_used_bytes: int


@dataclass(frozen=True)
class Pressure:
    """Pressure stall information: share of wall time tasks stalled on memory."""
    some_avg10: float  # ratios in [0, 1]
    some_avg60: float
    some_avg300: float
    full_avg10: float
    full_avg60: float
    full_avg300: float
    some_total_seconds: float  # cumulative stall time since boot (a counter)
    full_total_seconds: float


@dataclass(frozen=True)
class Cgroup:
    version: int  # 1 or 2
    path: str  # relative to the hierarchy root, e.g. "/system.slice/job.scope"
    limit_bytes: Optional[int]  # None when unlimited
    usage_bytes: Optional[int]
    high_bytes: Optional[int] = None  # v2 memory.high; None when unlimited or v1
    working_set_bytes: Optional[int] = None  # usage minus inactive file pages, as cAdvisor
    reclaimable_bytes: Optional[int] = None  # page cache the kernel reclaims before any kill (cgroup.py)
    shmem_bytes: Optional[int] = None  # shared memory (tmpfs, /dev/shm, memfd) charged to the group
    # File pages charged to the group that a process maps (the job's code, when the group paid for
    # reading it): reclaimable, but taken from a running job they come back as faults (budget.py)
    mapped_file_bytes: Optional[int] = None
    oom_events: Optional[int] = None  # times the limit was hit and reclaim failed
    oom_kill_events: Optional[int] = None
    pressure: Optional[Pressure] = None  # v2 memory.pressure
    # Counters: file pages of the group the kernel evicted and read back (workingset refaults, in
    # bytes), and the group's major faults. Together they tell a group thrashing where it has no
    # PSI (cgroup v1: policy.pressure.thrashing).
    refault_bytes: Optional[int] = None
    major_faults: Optional[int] = None


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: Optional[int]  # None when the driver does not say ("not available" is unknown)


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML's index: stable only within one boot, so match devices by uuid
    uuid: Optional[str]  # None only on an unhealthy device that never answered
    name: Optional[str]  # likewise
    total_bytes: Optional[int]
    used_bytes: Optional[int]  # excludes reserved_bytes where the v2 query is available
    free_bytes: Optional[int]
    reserved_bytes: Optional[int]  # driver/firmware reservation; None with the v1 query
    unified: bool  # memory is the host's (NVML says Not Supported, or an integrated part)
    utilization: Optional[float] = None  # ratio of time a kernel ran over the last period
    healthy: bool = True  # False when the device is lost or failed this sample
    error: Optional[str] = None
    processes: Tuple[GpuProcess, ...] = ()
    mig_parent_uuid: Optional[str] = None  # set on a MIG instance: the physical GPU's uuid
    pci_bus_id: Optional[str] = None  # NVML's busId ("00000000:3F:00.0"); None on a MIG instance
    gpu_instance_id: Optional[int] = None  # a MIG instance's GPU instance id (dcgm's GPU_I_ID)


def gpu_bytes(processes: Iterable[GpuProcess], pids: Optional[Container[int]] = None) -> Optional[int]:
    """The GPU memory ``processes`` use (only those of ``pids``, when given): the one rule for
    adding it up, over a job's processes on one GPU or one process's over GPUs. None when none
    is there (NVML lists no process of a container's pid namespace) or any of them does not
    say: the sum of the others would pass for the whole, and teach a curve a wrong point."""
    total, found = 0, False
    for proc in processes:
        if pids is not None and proc.pid not in pids:
            continue
        if proc.used_bytes is None:
            return None
        total += proc.used_bytes
        found = True
    return total if found else None


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    ppid: int
    name: str
    rss_bytes: Optional[int]  # counts shared (copy-on-write) pages in every process
    pss_bytes: Optional[int]  # shared pages split among their sharers: sums to the real total
    uss_bytes: Optional[int]  # pages only this process holds: what killing it would free
    gpu_bytes: Optional[int] = None
    # Anonymous pages mapped (heap, stacks), shared copy-on-write ones included: all that a forked
    # worker can come to own by writing to them; its library pages stay shared.
    anon_bytes: Optional[int] = None
    # CPU seconds it has used (user + system): a worker copies a dataset as it works, so its
    # growth is followed against its work, and a paused worker is not taken for a levelled one.
    cpu_seconds: Optional[float] = None
    # Shared memory (tmpfs, /dev/shm, memfd) it maps, split among its sharers (Pss_Shmem, kernels
    # 5.13 on): summed over a tree, what the tree maps of its group's shared memory.
    shmem_bytes: Optional[int] = None
    # The part of it no other process maps (at least; procs._private_shmem), counted in its USS:
    # a DataLoader worker's batch while it collates it, the loader's then, not the worker's.
    private_shmem_bytes: Optional[int] = None

    @property
    def own_bytes(self) -> int:
        """What it alone holds (USS, else RSS) less the shared memory it alone maps: as a worker,
        its own cost, without the batch it happens to be collating (JobMemory.in_flight_shmem_bytes)."""
        held = self.uss_bytes if self.uss_bytes is not None else (self.rss_bytes or 0)
        return held - (self.private_shmem_bytes or 0)


@dataclass(frozen=True)
class Snapshot:
    taken_at: float  # wall-clock seconds since the epoch
    monotonic: float  # time.monotonic() when taken, for ages and rates
    host: str
    memory_model: str  # DISCRETE, UNIFIED or CPU
    system: SystemMemory
    pressure: Optional[Pressure]  # None without PSI (old kernel, macOS)
    cgroup: Optional[Cgroup]  # the daemon's own cgroup; None when it cannot be read
    gpus: Tuple[Gpu, ...] = ()
    oom_kills: Optional[int] = None  # host-wide OOM kills since boot (/proc/vmstat oom_kill)
    apple_pressure_level: Optional[int] = None  # kern.memorystatus_vm_pressure_level (1, 2, 4)
    errors: Tuple[Tuple[str, str], ...] = ()  # (source, message) for reads that failed
    duration_seconds: float = 0.0
    processes: Optional[Tuple[ProcessMemory, ...]] = None  # a job's tree, only when asked for


@dataclass(frozen=True)
class JobMemory:
    """A job's process tree and cgroup (Sampler.job), as the policy sees it."""
    pid: int
    processes: Tuple[ProcessMemory, ...]
    cgroup: Optional[Cgroup]
    errors: Tuple[Tuple[str, str], ...]
    monotonic: float
    # The trainer's resident set, read right beside the cgroup's usage (the tree's slower read
    # lags a growing step by tens of MB): with it, free and held describe one instant.
    trainer_rss_bytes: Optional[int] = None
    cpus: Optional[float] = None  # CPUs the trainer may use: its affinity, within its cgroup's quota
    # The part of that resident set mapped from files (RssFile), read with it: page cache, which
    # the pool counts as reclaimable (free), so the trainer does not hold it there.
    trainer_file_bytes: Optional[int] = None
    # The host's MemAvailable, read with them: the host pool's free memory at the same instant.
    available_bytes: Optional[int] = None
    # The part of the trainer's resident set that is shared memory (RssShmem), read with it, and
    # (when, how much) at its reads of the last SHMEM_SPAN seconds (Sampler.paired keeps them)
    trainer_shmem_bytes: Optional[int] = None
    shmem_seen: Tuple[Tuple[float, int], ...] = ()
    # Its part of the shared memory of its group no trainer maps, where other trainers share the
    # group (Sampler.paired_pool splits it by what each unmapped lately); None: alone in it
    unmapped_share_bytes: Optional[int] = None
    # When those were read (Sampler.paired refreshes them between reads of the whole tree);
    # None: with the tree, at ``monotonic``.
    paired_at: Optional[float] = None

    @property
    def read_at(self) -> float:
        """When the job's pool and its trainer were last read together."""
        return self.monotonic if self.paired_at is None else self.paired_at

    @property
    def trainer_held_bytes(self) -> Optional[int]:
        """What the trainer holds in its pool, in the units the pool counts its use in: its
        resident set less its file pages (its anonymous and shared memory). Counted whole, a
        process's mapped libraries were counted twice, free as page cache and held as its own,
        and a budget in a 1 GiB group came to 1028 MiB (tests/test_budget_units.py)."""
        if self.trainer_rss_bytes is None:
            return None
        return max(0, self.trainer_rss_bytes - (self.trainer_file_bytes or 0))

    @property
    def alive(self) -> bool:
        return any(p.pid == self.pid for p in self.processes)

    @property
    def worker_bytes(self) -> List[int]:
        """What each descendant alone holds (ProcessMemory.own_bytes): the cost of one more worker."""
        return [p.own_bytes for p in self.processes if p.pid != self.pid]

    @property
    def unmapped_shmem_bytes(self) -> int:
        """Shared memory charged to the job's group that its trainer does not map now, up to the
        most it mapped lately (shmem_seen): a trainer alone in its group has that only for a
        moment, between unmapping a step's shared memory and the kernel giving it back, and it is
        the trainer's until then (planner.steadied). Beside other trainers, its share of what none
        of them maps (unmapped_share_bytes). 0 when either is unknown."""
        if self.unmapped_share_bytes is not None:
            return self.unmapped_share_bytes
        if self.cgroup is None or self.cgroup.shmem_bytes is None or self.trainer_shmem_bytes is None:
            return 0
        return min(self.shmem_lately_bytes, max(0, self.cgroup.shmem_bytes - self.trainer_shmem_bytes))

    @property
    def shmem_lately_bytes(self) -> int:
        """The most shared memory the trainer mapped lately, now included."""
        return max([self.trainer_shmem_bytes or 0] + [v for _, v in self.shmem_seen])

    @property
    def in_flight_shmem_bytes(self) -> Optional[int]:
        """A DataLoader's batches on their way from its workers to the trainer: a worker collates
        each into shared memory it alone maps, and lets go of it when it sends it; until the trainer
        maps it, it is in no process's resident set, yet in the group's usage. So: the shared memory
        charged to the job's cgroup that none of its processes maps, and what its workers alone map.
        None when the group's or a process's share is not known."""
        if self.cgroup is None or self.cgroup.shmem_bytes is None or not self.processes:
            return None
        mapped = [p.shmem_bytes for p in self.processes]
        if any(m is None for m in mapped):
            return None
        unmapped = max(0, self.cgroup.shmem_bytes - sum(m for m in mapped if m is not None))
        return unmapped + sum(p.private_shmem_bytes or 0 for p in self.processes if p.pid != self.pid)


def as_json(snapshot: Snapshot) -> Dict[str, Any]:
    """The `memd sample --json` contract (docs/platforms.md describes each field)."""
    out: Dict[str, Any] = {
        "host": snapshot.host,
        "taken_at": snapshot.taken_at,
        "memory_model": snapshot.memory_model,
        "system": asdict(snapshot.system),
        "pressure": _plain(snapshot.pressure),
        "cgroup": _plain(snapshot.cgroup),
        "gpus": [asdict(g) for g in snapshot.gpus],
        "oom_kills": snapshot.oom_kills,
        "errors": [{"source": s, "message": m} for s, m in snapshot.errors],
        "duration_seconds": snapshot.duration_seconds,
    }
    if snapshot.apple_pressure_level is not None:
        out["apple_pressure_level"] = snapshot.apple_pressure_level
    if snapshot.processes is not None:
        out["processes"] = [asdict(p) for p in snapshot.processes]
    return out


def _plain(record: Any) -> Optional[Dict[str, Any]]:
    return asdict(record) if record is not None else None

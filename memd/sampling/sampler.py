"""One entry point for a whole Snapshot, with every failure contained and reported.

Cheap signals (meminfo, PSI, vmstat, cgroup, NVML memory) are read on every sample; a job's
process tree (PSS/USS, ~0.2 ms a process) only when asked for, through ``job``.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from . import cgroup, platform, procs, system
from .snapshot import Cgroup, Gpu, GpuProcess, JobMemory, Snapshot, SystemMemory, gpu_bytes

Errors = List[Tuple[str, str]]
PAIR_READS, PAIR_GAP = 3, 0.01  # (cgroup usage, trainer RSS) pairs per job read, seconds apart
SHMEM_SPAN = 2.0  # seconds of a trainer's shared memory kept with its reads (JobMemory.unmapped_shmem_bytes)


class GpuSource(Protocol):
    def sample(self, host_total_bytes: Optional[int]) -> Tuple[Tuple[Gpu, ...], Errors]: ...


class Sampler:
    def __init__(self, gpus: Optional[GpuSource] = None, proc_root: str = "/proc", etc_root: str = "/etc",
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 apple_silicon: Optional[bool] = None,
                 sysctl: Callable[[str], Optional[str]] = platform.sysctl):
        """``apple_silicon`` None: ask this machine; ``sysctl`` reads a macOS sysctl (seams for
        tests, like ``proc_root`` and ``etc_root``)."""
        self.gpus = gpus
        self.proc_root = proc_root
        self.clock = clock
        self.wall = wall
        self.host = socket.gethostname()
        self.tegra = platform.is_tegra(etc_root)
        self.apple_silicon = platform.is_apple_silicon() if apple_silicon is None else apple_silicon
        self.sysctl = sysctl
        self._last_system: Optional[SystemMemory] = None

    def sample(self, pid: Optional[int] = None) -> Snapshot:
        """A snapshot now; with ``pid``, also that process tree (as ``processes``)."""
        start = self.clock()
        errors: Errors = []
        mem = self._system(errors)
        pressure = _guard(errors, "pressure", system.read_pressure, self.proc_root)
        oom_kills = _guard(errors, "vmstat", system.read_oom_kills, self.proc_root)
        cg = _guard(errors, "cgroup", cgroup.read_cgroup, None, self.proc_root)
        gpus: Tuple[Gpu, ...] = ()
        if self.gpus is not None:
            try:
                gpus, gpu_errors = self.gpus.sample(mem.total_bytes)
                errors.extend(gpu_errors)
            except Exception as exc:  # a GPU layer bug must not stop host sampling
                errors.append(("nvml", "GPU sampling failed: %r" % (exc,)))
        apple_level = platform.apple_pressure_level(self.sysctl) if self.apple_silicon else None
        processes = None
        if pid is not None:
            tree = procs.read_tree(pid, self.proc_root, detail=True, gpu_bytes=gpu_bytes_by_pid(gpus))
            processes = tree.processes
            errors.extend(tree.errors)
        return Snapshot(
            taken_at=self.wall(),
            monotonic=start,
            host=self.host,
            memory_model=platform.memory_model(gpus, self.tegra, self.apple_silicon),
            system=mem,
            pressure=pressure,
            cgroup=cg,
            gpus=gpus,
            oom_kills=oom_kills,
            apple_pressure_level=apple_level,
            errors=tuple(errors),
            duration_seconds=self.clock() - start,
            processes=processes,
        )

    @classmethod
    def default(cls) -> "Sampler":
        """This machine as it is: /proc, and NVIDIA GPUs through NVML when there are any."""
        from .nvml import Nvml

        return cls(gpus=Nvml())

    def close(self) -> None:
        shutdown = getattr(self.gpus, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def job(self, pid: int, gpus: Sequence[Gpu] = (), detail: bool = True) -> JobMemory:
        """A job's tree and cgroup; a vanished job comes back with no processes, not an error."""
        errors: Errors = []
        # Not the daemon itself: a job that started it (a test, a notebook) would count it as a worker.
        skip = (os.getpid(),) if self.proc_root == "/proc" else ()
        tree = procs.read_tree(pid, self.proc_root, detail=detail, gpu_bytes=gpu_bytes_by_pid(gpus), skip=skip)
        errors.extend(tree.errors)
        cg, resident, free = self._paired(pid, errors) if tree.processes else (None, None, None)
        return JobMemory(pid=pid, processes=tree.processes, cgroup=cg, errors=tuple(errors), monotonic=self.clock(),
                         trainer_rss_bytes=resident[0] if resident else None,
                         trainer_file_bytes=resident[1] if resident else None, available_bytes=free,
                         trainer_shmem_bytes=resident[2] if resident else None,
                         cpus=self._cpus(pid, errors) if tree.processes else None)

    def paired(self, job: JobMemory) -> JobMemory:
        """``job`` with its cgroup, its trainer's resident set and the host's MemAvailable read
        again, together, once (~70 us; the whole tree costs ~0.2 ms a process): between reads
        of its tree, the pool it draws on as of now. A neighbour growing in the job's group shows
        within a sample, not at the next read of the tree (job_interval). Unchanged when the
        trainer cannot be read."""
        return self.paired_pool([job])[0]

    def paired_pool(self, jobs: Sequence[JobMemory]) -> List[JobMemory]:
        """paired() for the jobs of one pool (one cgroup, or the host), all from one read of the
        pool and their trainers read right after it: what the pool holds beside the sessions is
        its use less each one's, and two jobs whose steps each map and free 0.8 GiB of shared
        memory, read 0.2 s apart, counted one's step as a neighbour's growth and cut the other
        to half (tests/test_budget_units.py, two real processes)."""
        if not jobs:
            return []
        errors: Errors = []
        cg = _guard(errors, "cgroup", cgroup.read_cgroup, jobs[0].pid, self.proc_root)
        free = _guard(errors, "system", system.read_available, self.proc_root)
        residents = [procs.read_resident(job.pid, self.proc_root) for job in jobs]
        now = self.clock()
        out = []
        for job, resident in zip(jobs, residents):
            if resident is None or (cg is None and job.cgroup is not None):
                out.append(job)
                continue
            seen = tuple((at, v) for at, v in job.shmem_seen if at >= now - SHMEM_SPAN)
            if job.trainer_shmem_bytes is not None:
                seen += ((job.read_at, job.trainer_shmem_bytes),)
            out.append(replace(job, cgroup=cg, trainer_rss_bytes=resident[0], trainer_file_bytes=resident[1],
                               trainer_shmem_bytes=resident[2], shmem_seen=seen[-16:],
                               available_bytes=free, paired_at=now))
        return out if None in residents else _split_unmapped(out, cg)  # a job not read keeps its last

    def _cpus(self, pid: int, errors: Errors) -> Optional[float]:
        """The CPUs the trainer may use: its affinity, within its cgroup's CPU quota."""
        known = [c for c in (procs.read_cpus_allowed(pid, self.proc_root),
                             _guard(errors, "cgroup", cgroup.read_cpu_limit, pid, self.proc_root)) if c is not None]
        return float(min(known)) if known else None

    def _paired(self, pid: int, errors: Errors):
        """(the job's cgroup, the trainer's (RSS, file pages), the host's MemAvailable) as of one
        instant: the budget adds what the job holds to what its pool has free. Read while a step
        frees hundreds of MB, one pair in twenty came 30-40 MiB apart (the RSS falls before the
        group is uncharged): three reads, PAIR_GAP apart, and the one with the median of (what the
        pool has in use - what the trainer holds) is kept (then one in forty). The host's free
        memory read at another instant (the sampler's snapshot) than the trainer's set counted
        a step's memory twice, free between steps and held at its peak: the README's loop on the
        host was budgeted 110 % of MemTotal."""
        reads = []
        for i in range(PAIR_READS):
            if i:
                time.sleep(PAIR_GAP)
            cg = _guard(errors, "cgroup", cgroup.read_cgroup, pid, self.proc_root)
            free = _guard(errors, "system", system.read_available, self.proc_root)
            resident = procs.read_resident(pid, self.proc_root)
            if resident is None or (cg is None or cg.usage_bytes is None) and free is None:
                return cg, resident, free
            held = resident[0] - resident[1]
            bound = cg is not None and cg.usage_bytes is not None and (cg.limit_bytes is not None or free is None)
            in_use = cg.usage_bytes if bound else -(free or 0)  # in the pool that bounds it: its group, or the host
            reads.append((in_use - held, cg, resident, free))
        reads.sort(key=lambda r: r[0])
        _, cg, resident, free = reads[len(reads) // 2]
        return cg, resident, free

    def _system(self, errors: Errors) -> SystemMemory:
        try:
            self._last_system = system.read_host_memory(self.proc_root)
        except (OSError, ValueError, KeyError) as exc:
            errors.append(("system", "meminfo unreadable: %s" % (exc,)))
            if self._last_system is None:
                self._last_system = system.read_system_memory()  # psutil's own reading
        return self._last_system


def _split_unmapped(jobs: List[JobMemory], group: Optional[Cgroup]) -> List[JobMemory]:
    """The shared memory of a group that none of its trainers maps (a step's, unmapped, until the
    kernel frees it), shared among them by how much less each maps than it did lately (else by
    the most each mapped: a step that maps its next before the last is freed): each one's at most
    what it mapped lately, and together never more than there is. Taken by each as its own, one
    trainer's pages counted twice held both jobs' claims a step high. A trainer alone gets what
    JobMemory.unmapped_shmem_bytes gives it."""
    if group is None or group.shmem_bytes is None or any(j.trainer_shmem_bytes is None for j in jobs):
        return jobs
    unmapped = max(0, group.shmem_bytes - sum(j.trainer_shmem_bytes or 0 for j in jobs))
    lately = [j.shmem_lately_bytes for j in jobs]
    weights = [m - (j.trainer_shmem_bytes or 0) for j, m in zip(jobs, lately)]
    if not any(weights):
        weights = lately
    total = sum(weights)
    return [replace(j, unmapped_share_bytes=min(m, unmapped * w // total) if total else 0)
            for j, m, w in zip(jobs, lately, weights)]


def gpu_bytes_by_pid(gpus: Sequence[Gpu]) -> Dict[int, Optional[int]]:
    """pid -> GPU memory over all devices (snapshot.gpu_bytes: None when any of its devices does
    not say). A pid on no GPU is absent."""
    found: Dict[int, List[GpuProcess]] = {}
    for gpu in gpus:
        for proc in gpu.processes:
            found.setdefault(proc.pid, []).append(proc)
    return {pid: gpu_bytes(procs) for pid, procs in found.items()}


def _guard(errors: Errors, source: str, read, *args):
    try:
        return read(*args)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        errors.append((source, "%s: %s" % (type(exc).__name__, exc)))
        return None

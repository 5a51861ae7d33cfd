"""What the daemon reads of a job's own process as a request is handled: whether it may watch it
(its pid checked), its memory cgroup at hello, and its peak at a report that does not say."""
from __future__ import annotations

import os
from typing import Optional, Tuple

from memd.core import Core
from memd.policy.budget import HOST, job_pids
from memd.sampling import cgroup as cgroups
from memd.sampling import procs
from memd.sampling.snapshot import Cgroup, gpu_bytes
from memd.sessions import Peer, SessionRecord


def as_seen_here(core: Core, pid: int, host: str, pid_ns: Optional[int], start_time: Optional[int],
                 peer: Optional[Peer]) -> Tuple[int, str, Optional[int]]:
    """(pid, host, pid_ns) of a hello as this daemon sees the process that sent it. A job in a
    container names itself by its pid and hostname there: as a stranger's, it was planned from its
    reports and never measured, and nothing it learned was kept. Over the ipc socket the kernel
    gives the daemon the sender's pid in the daemon's own pid namespace (SO_PEERCRED, ``peer``);
    when that process is the one the hello describes (in the pid namespace it names, with the
    pid it names there, started when it says), the hello is that process's, on this machine.
    Anything else is left as claimed, and checked as claimed (watchable)."""
    if peer is None or not peer.pid:  # over TCP, or a sender this daemon's pid namespace cannot see (pid 0)
        return pid, host, pid_ns
    own = procs.pid_namespace("self", core.proc_root)
    if pid_ns is None or pid_ns == own:
        same = pid == peer.pid
    else:
        same = (procs.pid_namespace(peer.pid, core.proc_root) == pid_ns
                and procs.innermost_pid(peer.pid, core.proc_root) == pid)
    if not same or (start_time is not None and procs.process_start_time(peer.pid, core.proc_root) != start_time):
        return pid, host, pid_ns
    return peer.pid, core.host, own if pid_ns is not None else None


def watchable(core: Core, host: str, pid: int, pid_ns: Optional[int], start_time: Optional[int],
              peer: Optional[Peer] = None) -> Tuple[bool, Optional[str]]:
    """Whether the pid a hello names is the client's own process here, which the daemon may
    measure, reset the peak of and watch; and if not, though the job is on this host, why (for
    its plan). A job in another pid namespace (a container sharing the hostname) names a pid
    that here is an unrelated process: pid_ns and start_time, when the client sends them, tell.
    A pid_ns the daemon cannot check against its own is not trusted: measuring a stranger is
    the harm this prevents, and a client that read its namespace runs on a kernel that shows
    the daemon its own, unless the daemon's /proc hides it (or the client's host is another
    machine of the same name). Where the kernel says who asks (``peer``), a process of another
    user is not watched unless root asks: its curves would be written by whoever named it."""
    if host != core.host:
        return False, None  # another machine: planned from its reports, as ever
    here = os.path.exists(os.path.join(core.proc_root, str(pid)))
    if pid_ns is not None:
        own = procs.pid_namespace("self", core.proc_root)
        if own is None:
            return False, "pid %d cannot be checked (the daemon cannot read its own pid namespace)" % pid
        if own != pid_ns:
            return False, ("pid %d here is another process (this job is in another pid namespace)" % pid if here
                           else "this job is in another pid namespace")
    if not here:
        return False, None
    if start_time is not None and procs.process_start_time(pid, core.proc_root) != start_time:
        return False, "pid %d here is another process (it started at another time than this job)" % pid
    if peer is not None and peer.uid != 0 and peer.uid != procs.process_owner(pid, core.proc_root):
        return False, "pid %d here is another user's process" % pid
    return True, None


def job_cgroup(core: Core, pid: int) -> Optional[Cgroup]:
    """The job's own memory cgroup, read as it says hello (through /proc/PID/cgroup, as the
    sampler reads it): the pool its curves are kept under and its first plan's bound, known
    before its first sample. None when there is none or it cannot be read (counted)."""
    try:
        return cgroups.read_cgroup(pid, core.proc_root)
    except (OSError, ValueError, KeyError, IndexError):
        core.sample_errors["cgroup"] += 1
        return None


def measure_peak(core: Core, session: SessionRecord) -> Optional[int]:
    """The job's peak since its last report, measured here: on a GPU pool what NVML attributes
    to the job's processes on that GPU (it includes what PyTorch's allocator keeps reserved);
    on the host pool the trainer's peak resident set less the file pages it maps (procs.read_peak:
    the units its pool counts what it holds in, JobMemory.trainer_held_bytes). None when unknown:
    a guess from another pool, or a partial sum (snapshot.gpu_bytes), would teach the curve a
    wrong point."""
    if not session.local or session.pool is None:  # not this host's process, or its GPU is unknown
        return None
    if session.pool != HOST:
        job, snapshot = core.jobs.get(session.pid), core.snapshot
        gpu = next((g for g in snapshot.gpus if g.uuid == session.pool), None) if snapshot else None
        if job is None or gpu is None:
            return None
        return gpu_bytes(gpu.processes, set(job_pids(job)))
    peak = procs.read_peak(session.pid, core.proc_root)
    procs.reset_peak_rss(session.pid, core.proc_root)
    return peak


def held_now(core: Core, pid: int) -> Optional[int]:
    """What the job's trainer holds now, in its pool's units (its resident set less its file
    pages: JobMemory.trainer_held_bytes), read as it says hello, before its first step: the
    framework, the model, the data it loaded; nothing its batch costs yet. The memory every step
    holds whatever its batch (Observation.base_bytes): a job whose first batch of 1 peaked at 2.08
    GiB beside 2.06 of it was bounded at 2.08 GiB a sample, and held at 1 for good."""
    resident = procs.read_resident(pid, core.proc_root)
    return None if resident is None else max(0, resident[0] - resident[1])

"""A job's process tree (the trainer and its dataloader workers) and what each one holds.

RSS counts copy-on-write pages in every process that maps them, so summing RSS over a forked
trainer and its workers counts the model several times; PSS splits shared pages among their
sharers (sums to the real total) and USS is what only that process holds (what killing it frees).
smaps_rollup gives all three in one read (~0.2 ms a process), so trees are read on demand, not
at the pressure sampling rate. Trees are walked through /proc/PID/task/TID/children (direct
children, ~20 us) rather than by scanning every process on the host.
"""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from typing import Collection, Dict, List, Optional, Tuple

from memd.client.procstat import parse_stat

from .snapshot import ProcessMemory

MAX_PROCESSES = 1024  # a runaway fork bomb must not make one sample unbounded
NO_SMAPS_ROLLUP = "no smaps_rollup (kernel older than 4.14)"
SMAPS_ROLLUP_DENIED = "smaps_rollup not readable (another user's process: memd needs CAP_SYS_PTRACE)"
_PIDS_SHOWN = 8  # pids named in a tree-wide error; the count says how many in all
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc/<pid>/stat's time unit


@dataclass(frozen=True)
class Tree:
    processes: Tuple[ProcessMemory, ...]
    errors: Tuple[Tuple[str, str], ...]  # (source, message): vanished or unreadable processes

    def total(self, field: str) -> Optional[int]:
        """Sum of one memory field over the tree; None when no process has it."""
        values = [getattr(p, field) for p in self.processes if getattr(p, field) is not None]
        return sum(values) if values else None

    @property
    def pids(self) -> Tuple[int, ...]:
        return tuple(p.pid for p in self.processes)


def read_tree(pid: int, proc_root: str = "/proc", detail: bool = True,
              gpu_bytes: Optional[Dict[int, Optional[int]]] = None, skip: Collection[int] = ()) -> Tree:
    """The process ``pid`` and all its descendants, parents before children, but for those in
    ``skip`` and theirs.

    ``detail`` reads smaps_rollup (PSS/USS); without it only RSS from statm (10x cheaper).
    ``gpu_bytes`` maps pid -> GPU memory from NVML, attached to the matching processes.
    A process that vanishes or cannot be read is left out with its reason in ``errors``; one
    whose smaps_rollup cannot be read (an old kernel, another user's process) is kept with RSS
    only, and the reason is said once for the tree, not once per process.
    """
    processes: List[ProcessMemory] = []
    errors: List[Tuple[str, str]] = []
    rss_only: Dict[str, List[int]] = {}  # why PSS/USS are unknown -> the pids concerned
    queue = collections.deque([pid])
    seen = set()
    while queue and len(processes) < MAX_PROCESSES:
        current = queue.popleft()
        if current in seen or (current in skip and current != pid):
            continue
        seen.add(current)
        try:
            process, why = _read_process(current, proc_root, detail, gpu_bytes)
        except FileNotFoundError:
            errors.append(("procs", "process %d vanished during the scan" % current))
            continue
        except (OSError, ValueError) as exc:
            errors.append(("procs", "process %d unreadable: %s" % (current, _reason(exc))))
            continue
        processes.append(process)
        if why is not None:
            rss_only.setdefault(why, []).append(current)
        try:
            queue.extend(children(current, proc_root))
        except OSError as exc:
            errors.append(("procs", "children of %d unreadable: %s" % (current, _reason(exc))))
    if queue:
        errors.append(("procs", "tree of %d truncated at %d processes" % (pid, MAX_PROCESSES)))
    for why, pids in rss_only.items():
        shown = ", ".join(str(p) for p in pids[:_PIDS_SHOWN]) + (", ..." if len(pids) > _PIDS_SHOWN else "")
        errors.append(("procs", "%s: PSS/USS unknown, RSS from statm for %d process%s (%s)"
                       % (why, len(pids), "" if len(pids) == 1 else "es", shown)))
    return Tree(tuple(processes), tuple(errors))


def read_process(pid: int, proc_root: str = "/proc", detail: bool = True,
                 gpu_bytes: Optional[Dict[int, Optional[int]]] = None) -> ProcessMemory:
    return _read_process(pid, proc_root, detail, gpu_bytes)[0]


def _read_process(pid: int, proc_root: str, detail: bool,
                  gpu_bytes: Optional[Dict[int, Optional[int]]]) -> Tuple[ProcessMemory, Optional[str]]:
    """The process's memory, and why PSS/USS are unknown when smaps_rollup could not be read.

    FileNotFoundError means the process is gone: raised by stat, or by statm after a missing
    smaps_rollup (a process that still has statm is on a kernel without smaps_rollup).
    """
    base = os.path.join(proc_root, str(pid))
    ppid, name, cpu = _stat(base)
    rss = pss = uss = anon = shmem = private_shmem = None
    why = None
    if detail:
        try:
            rss, pss, uss, anon, shmem = _smaps_rollup(base)
            private_shmem = _private_shmem(base, shmem, uss)
        except FileNotFoundError:
            why = NO_SMAPS_ROLLUP
        except PermissionError:
            why = SMAPS_ROLLUP_DENIED
    if rss is None:
        rss = _statm_rss(base)
    gpu = gpu_bytes.get(pid) if gpu_bytes else None
    return ProcessMemory(pid=pid, ppid=ppid, name=name, rss_bytes=rss, pss_bytes=pss, uss_bytes=uss,
                         gpu_bytes=gpu, anon_bytes=anon, cpu_seconds=cpu,
                         shmem_bytes=shmem, private_shmem_bytes=private_shmem), why


def children(pid: int, proc_root: str = "/proc") -> List[int]:
    """Direct children of every thread of ``pid`` (a worker may be forked from any thread)."""
    task_dir = os.path.join(proc_root, str(pid), "task")
    found: List[int] = []
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "children")) as f:
                found.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(os.path.join(task_dir, tid)):
                continue  # the thread ended between listdir and open
            return _children_by_scan(pid, proc_root)  # kernel without CONFIG_PROC_CHILDREN
    return found


def process_start_time(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """Start time in clock ticks since boot: with the pid, identifies a process across pid reuse."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat")) as f:
            return parse_stat(f.read()).start_time
    except (OSError, ValueError):
        return None


def innermost_pid(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """The process's pid in its own pid namespace (the last of NSpid in /proc/PID/status): what
    a job in a container calls itself. None when gone or unknown (kernels before 4.1)."""
    try:
        with open(os.path.join(proc_root, str(pid), "status")) as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_owner(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """The uid that owns a process (its /proc entry's owner: the effective uid), None when gone."""
    try:
        return os.stat(os.path.join(proc_root, str(pid))).st_uid
    except OSError:
        return None


def pid_namespace(pid: object = "self", proc_root: str = "/proc") -> Optional[int]:
    """The inode of a process's pid namespace (/proc/PID/ns/pid), None when unreadable: two
    processes mean the same process by a pid only when this is the same for both."""
    try:
        return os.stat(os.path.join(proc_root, str(pid), "ns", "pid")).st_ino
    except OSError:
        return None


def _stat(base: str) -> Tuple[int, str, Optional[float]]:
    """(ppid, name, CPU seconds used: user + system)."""
    with open(os.path.join(base, "stat")) as f:
        stat = parse_stat(f.read())
    return stat.ppid, stat.name, stat.cpu_ticks / CLOCK_TICKS if stat.cpu_ticks is not None else None


def _smaps_rollup(base: str) -> Tuple[Optional[int], Optional[int], Optional[int], Optional[int], Optional[int]]:
    values: Dict[str, int] = {}
    with open(os.path.join(base, "smaps_rollup")) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                values[key] = int(parts[0]) * 1024
    if "Rss" not in values:
        return None, None, None, None, None  # a kernel thread, or an exited process with no mappings
    uss = values.get("Private_Clean", 0) + values.get("Private_Dirty", 0) + values.get("Private_Hugetlb", 0)
    return values["Rss"], values.get("Pss"), uss, values.get("Anonymous"), values.get("Pss_Shmem")


def _private_shmem(base: str, pss_shmem: Optional[int], uss: Optional[int]) -> Optional[int]:
    """Shared memory only this process maps, at least: smaps_rollup splits shared memory by
    sharers (Pss_Shmem) but does not say how much of it is private, and status counts it whole
    (RssShmem). A page only it maps counts whole in both, one it shares at most half in the
    first, so at least 2 Pss_Shmem - RssShmem of it is its own: all of a batch a DataLoader
    worker collates into a fresh segment, none of a dataset it shares with the trainer.
    Read only when it maps any, as most processes map none most of the time."""
    if pss_shmem is None or uss is None:
        return None
    if pss_shmem == 0:
        return 0
    whole = _status_bytes(base, "RssShmem:")
    return None if whole is None else max(0, min(uss, 2 * pss_shmem - whole))


def read_cpus_allowed(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """How many CPUs the process may run on (its affinity: Cpus_allowed_list)."""
    try:
        with open(os.path.join(proc_root, str(pid), "status")) as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    count = 0
                    for part in line.split(":", 1)[1].strip().split(","):
                        low, _, high = part.partition("-")
                        count += int(high or low) - int(low) + 1
                    return count
    except (OSError, ValueError):
        return None
    return None


def read_rss(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """The process's resident set now (statm: ~20 us, cheap enough to pair with another read)."""
    try:
        return _statm_rss(os.path.join(proc_root, str(pid)))
    except (OSError, ValueError, IndexError):
        return None


def read_resident(pid: int, proc_root: str = "/proc") -> Optional[Tuple[int, int, Optional[int]]]:
    """(resident set, the part of it mapped from files, the part that is shared memory) now, from
    one read of /proc/PID/status (~25 us). The file pages are page cache: a pool counts them as
    reclaimable, so what the process holds there is the rest (its anonymous and shared memory).
    None when unreadable; the shared part None where it is not known."""
    found = _status_fields(os.path.join(proc_root, str(pid)), ("VmRSS:", "RssFile:", "RssShmem:"))
    if found is None or found[0] is None:
        rss = read_rss(pid, proc_root)  # no status to read (a fixture tree): statm, its files unknown
        return None if rss is None else (rss, 0, None)
    return found[0], found[1] or 0, found[2]


def read_peak(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """The process's peak since it started or since ``reset_peak_rss``, in a pool's units: its
    resident high-water mark (VmHWM) less the file pages it maps now (RssFile), which its pool
    counts as reclaimable page cache. Read at once from one status read; None when unreadable.
    File pages mapped at the peak and dropped since make it err high, never low (a trainer's
    libraries stay mapped: torch's 78 MiB of 217)."""
    found = _status_fields(os.path.join(proc_root, str(pid)), ("VmHWM:", "RssFile:"))
    if found is None or found[0] is None:
        return None
    return max(0, found[0] - (found[1] or 0))


def _status_fields(base: str, keys: Tuple[str, ...]) -> Optional[Tuple[Optional[int], ...]]:
    """kB lines of /proc/PID/status, in bytes, in the order of ``keys`` (None for one not there);
    None when the file cannot be read."""
    values: Dict[str, int] = {}
    try:
        with open(os.path.join(base, "status")) as f:
            for line in f:
                if line.startswith(keys):
                    key, _, rest = line.partition(":")
                    values[key + ":"] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return tuple(values.get(k) for k in keys)


def _statm_rss(base: str) -> int:
    with open(os.path.join(base, "statm")) as f:
        return int(f.read().split()[1]) * _PAGE


def _children_by_scan(pid: int, proc_root: str) -> List[int]:
    found = []
    for entry in os.listdir(proc_root):
        if entry.isdigit():
            try:
                if _stat(os.path.join(proc_root, entry))[0] == pid:
                    found.append(int(entry))
            except (OSError, ValueError):
                continue
    return found


def _reason(exc: BaseException) -> str:
    return exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)


def read_peak_rss(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """The process's peak resident set (VmHWM) since it started or since ``reset_peak_rss``."""
    return _status_bytes(os.path.join(proc_root, str(pid)), "VmHWM:")


def _status_bytes(base: str, key: str) -> Optional[int]:
    """A kB line of /proc/PID/status, in bytes; None when it cannot be read or is not there."""
    try:
        with open(os.path.join(base, "status")) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_rss(pid: int, proc_root: str = "/proc") -> bool:
    """Restart VmHWM from the current RSS (clear_refs 5; needs the same user, or root).

    Without it the peak only ever grows, which is safe (an upper bound) but slow to notice
    that a smaller batch costs less."""
    try:
        with open(os.path.join(proc_root, str(pid), "clear_refs"), "w") as f:
            f.write("5")
        return True
    except OSError:
        return False

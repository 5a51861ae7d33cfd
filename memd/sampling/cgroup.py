"""The memory cgroup a process lives in (v1 or v2): its ceiling, usage and OOM events.

A job in a container, a Slurm step or a Kubernetes pod is bounded by its own cgroup, not by the
host's RAM, so the budget must come from here. The effective limit is the smallest along the
path to the root (a parent's limit binds its children). Working set is usage minus inactive
file pages, as cAdvisor and the kubelet compute it (exported as such); reclaimable is the page
cache the kernel takes back before it kills anything in the group: a budget counts it as free.
That is every page on the file LRU lists, mapped or not: a clean file page can always be dropped
and read again, and the OOM killer acts only when reclaim makes no progress (the benchmark's
workers job at the batch that just fits had its group's file pages taken from 210 MiB to about
10, the mapped ones from 52 to 5, and finished; another run there, the cores shared, stalled at
the limit with 3 MiB of file pages left). What the running code keeps mapped is what the budget's
margin leaves.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, TypeVar

from .snapshot import Cgroup
from .system import parse_pressure, psi_disabled

# v1 reports "no limit" as the largest signed 64-bit value rounded down to the page size, which
# depends on the kernel: 0x7FFFFFFFFFFFF000 with 4 KiB pages, 0x7FFFFFFFFFFF0000 with 64 KiB
# (arm64, ppc64le). No real limit comes near 2**62 bytes (4 EiB), so anything above is "none".
_V1_UNLIMITED = 1 << 62
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # memory.stat counts pages


@dataclass(frozen=True)
class _Mount:
    root: str  # the hierarchy path mounted there (not "/" inside containers without cgroupns)
    point: str
    version: int


def read_cgroup(pid: Optional[int] = None, proc_root: str = "/proc") -> Optional[Cgroup]:
    """The memory cgroup of ``pid`` (default: this process); None when there is none to read.

    Raises OSError/ValueError on unreadable files; the Sampler reports those as errors.
    """
    who = str(pid) if pid is not None else "self"
    memberships = _memberships(os.path.join(proc_root, who, "cgroup"))
    mounts = _mounts(os.path.join(proc_root, "self", "mountinfo"))
    v1 = memberships.get("memory")
    if v1 is not None and "memory" in mounts:
        return _read_v1(mounts["memory"], v1)
    v2 = memberships.get("")
    if v2 is not None and "" in mounts:
        mount = mounts[""]
        if "memory" in _controllers(mount):
            return _read_v2(mount, v2)
    return None


def read_oom_kills(path: str, version: int, proc_root: str = "/proc") -> Optional[int]:
    """The OOM killer's kills in the memory cgroup at ``path`` (Cgroup.path; ``version`` 1 or 2),
    read by its path: a job's group outlives the job, so its count is read after the job is gone
    (memd.ops.lifecycle). None when the group or its mount is gone."""
    mounts = _mounts(os.path.join(proc_root, "self", "mountinfo"))
    mount = mounts.get("memory" if version == 1 else "")
    if mount is None:
        return None
    name = "memory.oom_control" if version == 1 else "memory.events"
    try:
        return _flat_keyed(os.path.join(_directory(mount, path), name)).get("oom_kill")
    except OSError:
        return None


def _memberships(path: str) -> Dict[str, str]:
    """controller -> path from /proc/PID/cgroup ("" is the v2 unified hierarchy)."""
    found: Dict[str, str] = {}
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) != 3:
                continue
            _, controllers, cgpath = parts
            if controllers == "":
                found[""] = cgpath
            for name in controllers.split(","):
                if name:
                    found[name] = cgpath
    return found


def read_cpu_limit(pid: Optional[int] = None, proc_root: str = "/proc") -> Optional[float]:
    """The CPUs a process's cgroup lets it use (its CFS quota over its period, the smallest along
    the path to the root); None when unlimited or unreadable as such. Raises OSError/ValueError
    on unreadable files, like read_cgroup."""
    who = str(pid) if pid is not None else "self"
    memberships = _memberships(os.path.join(proc_root, who, "cgroup"))
    mounts = _mounts(os.path.join(proc_root, "self", "mountinfo"))
    limit: Optional[float] = None
    if "cpu" in memberships and "cpu" in mounts:
        for walk in _up(mounts["cpu"], memberships["cpu"]):
            quota = _int_file(os.path.join(walk, "cpu.cfs_quota_us"), missing_ok=True)
            period = _int_file(os.path.join(walk, "cpu.cfs_period_us"), missing_ok=True)
            if quota is not None and quota > 0 and period:
                limit = _smaller(limit, quota / period)
        return limit
    if "" in memberships and "" in mounts:
        for walk in _up(mounts[""], memberships[""]):
            try:
                with open(os.path.join(walk, "cpu.max")) as f:
                    allowed, _, every = f.read().strip().partition(" ")  # "max 100000" or "250000 100000"
            except FileNotFoundError:
                continue
            if allowed != "max" and every:
                limit = _smaller(limit, int(allowed) / int(every))
    return limit


def _mounts(path: str) -> Dict[str, _Mount]:
    """"memory" and "cpu" -> their v1 mounts, "" -> the v2 mount, from mountinfo."""
    found: Dict[str, _Mount] = {}
    with open(path) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            fstype, options = tail[0], tail[2].split(",")
            root, point = _unescape(fields[3]), _unescape(fields[4])
            if fstype == "cgroup2" and "" not in found:
                found[""] = _Mount(root, point, 2)
            elif fstype == "cgroup":
                for controller in ("memory", "cpu"):
                    if controller in options and controller not in found:
                        found[controller] = _Mount(root, point, 1)
    return found


def _up(mount: _Mount, cgpath: str) -> Iterator[str]:
    """The cgroup's directory, then each parent up to the mount point: a parent's limit binds
    its children."""
    walk = _directory(mount, cgpath)
    while True:
        yield walk
        parent = os.path.dirname(walk)
        if os.path.normpath(walk) == os.path.normpath(mount.point) or parent == walk:
            return
        walk = parent


def _directory(mount: _Mount, cgpath: str) -> str:
    rel = cgpath
    if mount.root != "/" and (rel == mount.root or rel.startswith(mount.root + "/")):
        rel = rel[len(mount.root):]  # a container seeing a subtree mounted at its root
    return os.path.join(mount.point, rel.lstrip("/"))


def _controllers(mount: _Mount) -> List[str]:
    try:
        with open(os.path.join(mount.point, "cgroup.controllers")) as f:
            return f.read().split()
    except OSError:
        return []


def _read_v1(mount: _Mount, cgpath: str) -> Cgroup:
    d = _directory(mount, cgpath)
    stat = _flat_keyed(os.path.join(d, "memory.stat"))
    limit = stat.get("hierarchical_memory_limit")
    if limit is None:
        limit = _int_file(os.path.join(d, "memory.limit_in_bytes"))
    usage = _int_file(os.path.join(d, "memory.usage_in_bytes"))
    inactive = stat.get("total_inactive_file", stat.get("inactive_file"))
    oom = _flat_keyed(os.path.join(d, "memory.oom_control"), missing_ok=True)
    return Cgroup(
        version=1,
        path=cgpath,
        limit_bytes=None if limit is None or limit >= _V1_UNLIMITED else limit,
        usage_bytes=usage,
        working_set_bytes=_working_set(usage, inactive),
        reclaimable_bytes=_reclaimable(stat, "total_active_file", "total_inactive_file"),
        shmem_bytes=stat.get("total_shmem", stat.get("shmem")),
        mapped_file_bytes=stat.get("total_mapped_file", stat.get("mapped_file")),
        oom_kill_events=oom.get("oom_kill"),
        refault_bytes=_refaults(stat, "total_"),
        major_faults=stat.get("total_pgmajfault", stat.get("pgmajfault")),
    )


def _read_v2(mount: _Mount, cgpath: str) -> Cgroup:
    d = _directory(mount, cgpath)
    limit = high = None
    for walk in _up(mount, cgpath):  # the smallest memory.max up to the mount point binds
        limit = _smaller(limit, _v2_limit(os.path.join(walk, "memory.max")))
        high = _smaller(high, _v2_limit(os.path.join(walk, "memory.high")))
    usage = _int_file(os.path.join(d, "memory.current"), missing_ok=True)
    stat = _flat_keyed(os.path.join(d, "memory.stat"), missing_ok=True)
    events = _flat_keyed(os.path.join(d, "memory.events"), missing_ok=True)
    pressure = None
    try:
        with open(os.path.join(d, "memory.pressure")) as f:
            pressure = parse_pressure(f.read())
    except (FileNotFoundError, ValueError):
        pass
    except OSError as exc:
        if not psi_disabled(exc):
            raise
    return Cgroup(
        version=2,
        path=cgpath,
        limit_bytes=limit,
        usage_bytes=usage,
        high_bytes=high,
        working_set_bytes=_working_set(usage, stat.get("inactive_file")),
        reclaimable_bytes=_reclaimable(stat, "active_file", "inactive_file"),
        shmem_bytes=stat.get("shmem"),
        mapped_file_bytes=stat.get("file_mapped"),
        oom_events=events.get("oom"),
        oom_kill_events=events.get("oom_kill"),
        pressure=pressure,
        refault_bytes=_refaults(stat, ""),
        major_faults=stat.get("pgmajfault"),
    )


def _v2_limit(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None  # the root cgroup has no memory.max
    return None if text == "max" else int(text)


_N = TypeVar("_N", int, float)


def _smaller(a: Optional[_N], b: Optional[_N]) -> Optional[_N]:
    if a is None:
        return b
    return a if b is None else min(a, b)


def _working_set(usage: Optional[int], inactive_file: Optional[int]) -> Optional[int]:
    if usage is None:
        return None
    return max(0, usage - (inactive_file or 0))


def _refaults(stat: Dict[str, int], prefix: str) -> Optional[int]:
    """File pages the group read back after the kernel evicted them, in bytes; kernels before 5.9
    count file and anonymous refaults together (``workingset_refault``). v1's ``total_`` keys
    count the group's children too."""
    pages = stat.get(prefix + "workingset_refault_file", stat.get(prefix + "workingset_refault"))
    if pages is None and prefix:
        return _refaults(stat, "")
    return None if pages is None else pages * PAGE_SIZE


def _reclaimable(stat: Dict[str, int], active: str, inactive: str) -> Optional[int]:
    """The file LRU's pages; None when not reported."""
    if active not in stat or inactive not in stat:
        return None
    return stat[active] + stat[inactive]


def _int_file(path: str, missing_ok: bool = False) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        if missing_ok:
            return None
        raise


def _flat_keyed(path: str, missing_ok: bool = False) -> Dict[str, int]:
    values: Dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                    values[parts[0]] = int(parts[1])
    except FileNotFoundError:
        if not missing_ok:
            raise
    return values


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    return field.encode().decode("unicode_escape") if "\\" in field else field

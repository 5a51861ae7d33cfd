"""Host memory, memory pressure (PSI) and the kernel's OOM-kill counter.

Each reader takes the /proc root as a parameter so tests can point it at a fixture tree, and
raises OSError/ValueError on an unreadable or malformed file; the Sampler turns those into
``None`` plus an error entry, so one bad file never spoils the rest of a snapshot.
"""
from __future__ import annotations

import errno
import os
import sys
from typing import Optional

import psutil

from .snapshot import Pressure, SystemMemory


def read_system_memory() -> SystemMemory:
    vm = psutil.virtual_memory()
    swap = psutil.swap_memory()
    return SystemMemory(
        total_bytes=int(vm.total),
        available_bytes=int(vm.available),
        used_bytes=int(vm.total - vm.available),
        swap_total_bytes=int(swap.total),
        swap_used_bytes=int(swap.used),
    )


def read_host_memory(proc_root: str = "/proc") -> SystemMemory:
    """The host's memory as memd reads it everywhere (the sampler, and doctor's NVML check that
    must classify devices as the daemon does): /proc/meminfo on Linux, so that a fixture tree
    stands in for the machine; psutil elsewhere. Raises OSError, ValueError or KeyError."""
    if sys.platform.startswith("linux"):
        return read_meminfo(proc_root)
    return read_system_memory()


def read_meminfo(proc_root: str = "/proc") -> SystemMemory:
    """The same record from /proc/meminfo directly (fixture trees, or psutil-free callers)."""
    fields = {}
    with open(os.path.join(proc_root, "meminfo")) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                fields[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    total = fields["MemTotal"]
    if "MemAvailable" in fields:
        available = fields["MemAvailable"]
    else:  # kernels before 3.14: the same estimate psutil makes
        available = fields.get("MemFree", 0) + fields.get("Cached", 0) + fields.get("Buffers", 0)
    swap_total = fields.get("SwapTotal", 0)
    return SystemMemory(
        total_bytes=total,
        available_bytes=available,
        used_bytes=total - available,
        swap_total_bytes=swap_total,
        swap_used_bytes=swap_total - fields.get("SwapFree", swap_total),
    )


def read_available(proc_root: str = "/proc") -> Optional[int]:
    """MemAvailable alone (one read of /proc/meminfo, ~20 us: paired with a job's read); None where
    /proc/meminfo has no such line (a kernel before 3.14, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    with open(os.path.join(proc_root, "meminfo")) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def parse_pressure(text: str) -> Pressure:
    """Parse a PSI file (/proc/pressure/memory or a cgroup's memory.pressure).

    ``some avg10=1.23 avg60=0.50 avg300=0.10 total=123456`` (percent, and microseconds);
    returns ratios in [0, 1] and seconds. A file without a ``full`` line (the CPU file on old
    kernels) reads as zero full stall.
    """
    values = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind not in ("some", "full"):
            continue
        for item in rest.split():
            key, _, value = item.partition("=")
            values[kind + "_" + key] = float(value)
    if "some_avg10" not in values:
        raise ValueError("no 'some' line in PSI data")

    def ratio(key: str) -> float:
        return min(1.0, max(0.0, values.get(key, 0.0) / 100.0))

    return Pressure(
        some_avg10=ratio("some_avg10"),
        some_avg60=ratio("some_avg60"),
        some_avg300=ratio("some_avg300"),
        full_avg10=ratio("full_avg10"),
        full_avg60=ratio("full_avg60"),
        full_avg300=ratio("full_avg300"),
        some_total_seconds=values.get("some_total", 0.0) / 1e6,
        full_total_seconds=values.get("full_total", 0.0) / 1e6,
    )


def read_pressure(proc_root: str = "/proc") -> Optional[Pressure]:
    """Host memory PSI; None when the kernel has none (before 4.20, psi=0, or not Linux)."""
    path = os.path.join(proc_root, "pressure", "memory")
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        if psi_disabled(exc):
            return None
        raise
    return parse_pressure(text)


def psi_disabled(exc: OSError) -> bool:
    """Whether reading a PSI file failed because the kernel has PSI compiled in but switched off
    (booted with psi=0): the file exists and reading it fails EOPNOTSUPP (EINVAL on some kernels)."""
    return exc.errno in (errno.EOPNOTSUPP, errno.EINVAL)


def read_oom_kills(proc_root: str = "/proc") -> Optional[int]:
    """Host-wide OOM kills since boot (/proc/vmstat oom_kill, Linux >= 4.13)."""
    try:
        with open(os.path.join(proc_root, "vmstat")) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except FileNotFoundError:
        return None
    return None

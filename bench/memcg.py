"""A real memory cgroup to run a job in (v1 where its memory controller is mounted, else v2).

    with MemoryCgroup(1 << 30) as cg:
        proc = subprocess.Popen(cmd, preexec_fn=cg.join)
        proc.wait()
        killed = cg.oom_kills() > 0

Needs root (or a delegated subtree). Swap is shut out where the kernel allows it, so a job over
its limit is killed, as in a container without swap, instead of slowing down on disk. The group
is removed on exit, its processes killed first. Shared by the real-workload benchmark and the
test that runs a real job under a real limit.
"""
from __future__ import annotations

import os
import signal
import time
import uuid
from typing import List, Optional

V1_ROOT = "/sys/fs/cgroup/memory"
V2_ROOT = "/sys/fs/cgroup"


def available() -> Optional[str]:
    """Why no cgroup can be made here, or None when one can."""
    if os.path.isdir(V1_ROOT):
        return None if os.access(V1_ROOT, os.W_OK) else "cgroup v1 memory controller not writable (needs root)"
    try:
        with open(os.path.join(V2_ROOT, "cgroup.controllers")) as f:
            if "memory" not in f.read().split():
                return "cgroup v2 without the memory controller"
    except OSError:
        return "no cgroup filesystem at %s" % V2_ROOT
    return None if os.access(V2_ROOT, os.W_OK) else "cgroup v2 root not writable (needs root)"


class MemoryCgroup:
    def __init__(self, limit_bytes: int, name: Optional[str] = None):
        why = available()
        if why is not None:
            raise RuntimeError(why)
        self.version = 1 if os.path.isdir(V1_ROOT) else 2
        self.limit_bytes = int(limit_bytes)
        root = V1_ROOT if self.version == 1 else V2_ROOT
        self.path = os.path.join(root, name or "memd-bench-%s" % uuid.uuid4().hex[:10])
        if self.version == 2:
            _write(os.path.join(V2_ROOT, "cgroup.subtree_control"), "+memory", missing_ok=True)
        os.mkdir(self.path)
        try:
            if self.version == 1:
                self._set("memory.limit_in_bytes", self.limit_bytes)
                self._set("memory.memsw.limit_in_bytes", self.limit_bytes, optional=True)  # no swap
                self._set("memory.swappiness", 0, optional=True)
            else:
                self._set("memory.max", self.limit_bytes)
                self._set("memory.swap.max", 0, optional=True)
        except BaseException:
            os.rmdir(self.path)
            raise

    def join(self) -> None:
        """Move the calling process in (use as Popen's preexec_fn: the child joins before exec)."""
        _write(os.path.join(self.path, "cgroup.procs"), str(os.getpid()))

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer took from this group."""
        if self.version == 1:
            return _keyed(os.path.join(self.path, "memory.oom_control")).get("oom_kill", 0)
        return _keyed(os.path.join(self.path, "memory.events")).get("oom_kill", 0)

    def peak_bytes(self) -> Optional[int]:
        """The group's highest charge (page cache included)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            with open(os.path.join(self.path, name)) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def pids(self) -> List[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    def remove(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _set(self, name: str, value: int, optional: bool = False) -> None:
        _write(os.path.join(self.path, name), str(value), missing_ok=optional)


def _write(path: str, text: str, missing_ok: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except FileNotFoundError:
        if not missing_ok:
            raise


def _keyed(path: str) -> dict:
    values = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1].isdigit():
                    values[parts[0]] = int(parts[1])
    except OSError:
        pass
    return values

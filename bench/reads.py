"""What a running job holds, read every half second: its trainer, each of its workers, its group.

One JSON line per read, in MiB: the trainer's VmHWM, VmRSS, RssAnon, RssFile and RssShmem
(/proc/PID/status), each child's private pages and the part of them in its C heap (``heap``:
[heap] in /proc/PID/smaps; the trainer's private pages from /proc/PID/smaps_rollup), RssShmem
and CPU seconds (/proc/PID/stat), the group's memory.stat (v1: cache, rss, shmem, mapped_file,
active_file, inactive_file; pgmajfault and workingset_refault_file as counts) with its usage and
the kernel's high-water mark of it (``peak``: memory.max_usage_in_bytes, since the group was
made). Read by the benchmark itself, beside the job. With an endpoint, each line also holds memd's view of the job
at that moment (``memd``: its session's budget, predicted peak and plan, from `status`): what
memd decided on, kept apart from what was measured.
Used by bench/composition.py (a job at a fixed batch) and bench/realjobs.py --log-reads (memd's runs).

    .venv/bin/python bench/reads.py FILE...   (FILE.jsonl or FILE.jsonl.gz)

prints, for reads already logged, each life of the job's DataLoader workers (a loop that rebuilds
its loader forks new ones; told by their CPU seconds starting over): the batch memd had planned,
when it began and ended, the most each worker held (the median of the workers), and the trainer's
highest VmHWM meanwhile. What each rebuild cost shows as the lives go by.
"""
from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import IO, Iterator, List, Optional, Tuple

STATUS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
GROUP = ("cache", "rss", "shmem", "mapped_file", "active_file", "inactive_file")
# Counts, not bytes: pages faulted in from disk, and file pages read again after the group's
# reclaim dropped them (a job that runs only by evicting its own code's pages thrashes).
COUNTS = ("pgmajfault", "workingset_refault_file")


def status(pid: int, heap: bool = False) -> dict:
    out: dict = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in STATUS:
                    out[key] = int(value.split()[0]) // 1024
        if heap:  # smaps has both: one walk of the process's mappings, not two
            in_heap, rest = smaps_private(pid)
            out["private"], out["heap"] = (in_heap + rest) // 1024, in_heap // 1024
        else:
            with open("/proc/%d/smaps_rollup" % pid) as f:
                out["private"] = sum(int(line.split()[1]) for line in f
                                     if line.startswith(("Private_Clean:", "Private_Dirty:"))) // 1024
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rpartition(")")[2].split()
        out["cpu"] = round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)  # utime + stime
    except OSError:
        pass  # it exited between the listing and the read
    return out


def smaps_private(pid: int) -> Tuple[int, int]:
    """(KiB private in the C heap, KiB private elsewhere) of one process: glibc's brk arena is
    [heap] in /proc/PID/smaps."""
    heap = rest = 0
    where = None
    with open("/proc/%d/smaps" % pid) as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):  # a mapping: range, ..., name
                where = parts[5] if len(parts) > 5 else ""
            elif parts and parts[0] in ("Private_Clean:", "Private_Dirty:"):
                if where == "[heap]":
                    heap += int(parts[1])
                else:
                    rest += int(parts[1])
    return heap, rest


def heap_private(pid: int) -> int:
    """MiB of ``pid``'s private pages in its C heap."""
    return smaps_private(pid)[0] // 1024


def group(path: Optional[str]) -> dict:
    out: dict = {}
    if path is None:  # a GPU row's job: no cgroup of its own
        return out
    try:
        with open(os.path.join(path, "memory.stat")) as f:
            for line in f:
                key, value = line.split()
                if key in GROUP:
                    out[key] = int(value) >> 20
                elif key in COUNTS:
                    out[key] = int(value)
        with open(os.path.join(path, "memory.usage_in_bytes")) as f:
            out["usage"] = int(f.read()) >> 20
        with open(os.path.join(path, "memory.max_usage_in_bytes")) as f:
            out["peak"] = int(f.read()) >> 20
    except OSError:
        pass  # v2 names these otherwise: this reads v1 only
    return out


def children(pid: int) -> List[int]:
    return [int(k) for k in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def read(pid: int, group_path: Optional[str], started: float) -> dict:
    return dict(t=round(time.monotonic() - started, 1), trainer=status(pid),
                workers=[status(k, heap=True) for k in children(pid)], group=group(group_path))


def memd_view(endpoint: str, pid: int) -> Optional[dict]:
    """The session of the job ``pid`` as memd's `status` shows it, in MiB; None if not there."""
    from memd.client import DaemonUnavailable, call
    try:
        reply = call("status", endpoint=endpoint, timeout=0.5)
    except DaemonUnavailable:
        return None
    for s in reply.get("sessions", []):
        if s.get("pid") == pid:
            mib = lambda v: None if v is None else round(v / 2 ** 20, 1)  # noqa: E731
            plan = s.get("plan") or {}
            workers = s.get("workers")
            if workers:
                workers = {k.replace("_bytes", ""): [mib(b) for b in v] if isinstance(v, list) else
                           mib(v) if k.endswith("_bytes") else v for k, v in workers.items()}
            return dict(budget=mib(s.get("budget_bytes")), pool_budget=mib(s.get("pool_budget_bytes")),
                        predicted=mib(s.get("predicted_peak_bytes")), latest_peak=mib(s.get("latest_peak_bytes")),
                        batch=plan.get("batch_size"), reason=plan.get("reason"), workers=workers,
                        pressure=plan.get("pressure"), cgroup_pressure=s.get("cgroup_pressure_level"))
    return None


class Reader:
    """Reads a running job into the file ``path`` every ``every`` seconds, in a thread, until stopped."""

    def __init__(self, pid: int, group_path: Optional[str], path: str, every: float = 0.5,
                 endpoint: Optional[str] = None):
        self.pid, self.group_path, self.every, self.endpoint = pid, group_path, every, endpoint
        self.out = open(path, "w")
        self.started = time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(self.every):
            line = read(self.pid, self.group_path, self.started)
            if self.endpoint:
                line["memd"] = memd_view(self.endpoint, self.pid)
            self.out.write(json.dumps(line) + "\n")
            self.out.flush()

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.out.close()


def opened(path: str) -> IO[str]:
    """A log as written or gzipped as kept in docs/results."""
    return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def lives(path: str) -> Iterator[dict]:
    """The lives of a logged job's workers (see the module's docstring), oldest first."""
    life: Optional[dict] = None
    before: List[float] = []
    with opened(path) as f:
        for line in f:
            r = json.loads(line)
            workers = [w for w in r.get("workers") or [] if isinstance(w, dict) and w.get("private") is not None]
            if not workers:
                continue
            cpu = [w.get("cpu") or 0.0 for w in workers]
            if life is None or len(cpu) != len(before) or min(cpu) < min(before):
                if life is not None:
                    yield life
                life = dict(batch=(r.get("memd") or {}).get("batch"), start=r["t"], most=[0] * len(workers), hwm=0)
            before = cpu
            life["end"] = r["t"]
            life["most"] = [max(m, w["private"]) for m, w in zip(life["most"], workers)]
            life["hwm"] = max(life["hwm"], (r.get("trainer") or {}).get("VmHWM") or 0)
    if life is not None:
        yield life


def main(paths: List[str]) -> int:
    for path in paths:
        print(os.path.basename(path))
        for life in lives(path):
            print("  batch %s, %.0f-%.0f s: workers up to %s MiB (median %.0f), trainer VmHWM up to %d MiB" % (
                life["batch"], life["start"], life["end"], "/".join(map(str, life["most"])),
                statistics.median(life["most"]), life["hwm"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

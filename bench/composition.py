"""What a job at a fixed batch holds, read every half second, in a fresh memory cgroup of a row's size.

    sudo .venv/bin/python bench/composition.py --row workers-2g --batch 138 --steps 180 --out FILE

Runs bench/trainjob.py --method fixed (with memd's steady heap) and writes one JSON line per read:
the trainer's VmRSS, RssAnon, RssFile, RssShmem and VmHWM (/proc/PID/status), each worker's private
pages (/proc/PID/smaps_rollup) and the group's memory.stat (v1: cache, rss, shmem, mapped_file,
active_file, inactive_file) with its usage, in MiB; the job's own step events go to FILE.steps.
It shows what the kernel takes back before it kills: near the limit the group's file pages and the
trainer's library pages shrink while the job runs on (docs/results.md, the workers row).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import realjobs  # noqa: E402

STATUS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
GROUP = ("cache", "rss", "shmem", "mapped_file", "active_file", "inactive_file")


def status(pid: int) -> dict:
    out: dict = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in STATUS:
                    out[key] = int(value.split()[0]) // 1024
        with open("/proc/%d/smaps_rollup" % pid) as f:
            out["private"] = sum(int(line.split()[1]) for line in f
                                 if line.startswith(("Private_Clean:", "Private_Dirty:"))) // 1024
    except OSError:
        pass  # it exited between the listing and the read
    return out


def group(path: str) -> dict:
    out: dict = {}
    try:
        with open(os.path.join(path, "memory.stat")) as f:
            for line in f:
                key, value = line.split()
                if key in GROUP:
                    out[key] = int(value) >> 20
        with open(os.path.join(path, "memory.usage_in_bytes")) as f:
            out["usage"] = int(f.read()) >> 20
    except OSError:
        pass  # v2 names these otherwise: this reads v1 only
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="workers-2g", choices=sorted(realjobs.ROWS))
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    row = realjobs.ROWS[args.row]
    cmd = [sys.executable, realjobs.JOB, "--shape", row.shape, "--workers", str(row.workers), "--method", "fixed",
           "--batch", str(args.batch), "--steps", str(args.steps), "--steady-heap"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([realjobs.ROOT, os.path.join(realjobs.ROOT, "client")]))
    with realjobs.MemoryCgroup(row.limit_bytes) as cg, open(args.out, "w") as log, \
            open(args.out + ".steps", "w") as steps:
        proc = subprocess.Popen(cmd, stdout=steps, stderr=subprocess.DEVNULL, env=env, preexec_fn=cg.join)
        started = time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            log.write(json.dumps(dict(t=round(time.monotonic() - started, 1), trainer=status(proc.pid),
                                      workers=[status(int(k)) for k in kids], group=group(cg.path))) + "\n")
            log.flush()
        print("exit %s, killed %s, group peak %d MiB" % (proc.returncode, cg.oom_kills() > 0, cg.peak_bytes() >> 20))


if __name__ == "__main__":
    main()

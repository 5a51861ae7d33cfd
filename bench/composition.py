"""What a job at a fixed batch holds, read every half second, in a fresh memory cgroup of a row's size.

    sudo .venv/bin/python bench/composition.py --row workers-2g --batch 138 --steps 180 --out FILE

Runs bench/trainjob.py --method fixed (with memd's steady heap) and writes one JSON line per read:
the trainer's VmRSS, RssAnon, RssFile, RssShmem and VmHWM (/proc/PID/status), each worker's private
pages (/proc/PID/smaps_rollup) and the group's memory.stat (v1: cache, rss, shmem, mapped_file,
active_file, inactive_file) with its usage, in MiB; the job's own step events go to FILE.steps.
It shows what the kernel takes back before it kills: near the limit the group's file pages and the
trainer's library pages shrink while the job runs on (docs/results.md, the workers row).

    .venv/bin/python bench/composition.py --summarize FILE...

prints, for runs already logged, the median seconds a step took past the first 20 steps (where the
workers have copied most of what they will), samples a second at that median, and the group's file
pages (min and median over the last two thirds of the reads): a batch that runs only by evicting
the pages its job maps is slow, not killed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import realjobs  # noqa: E402
from bench.reads import read  # noqa: E402


def summarize(path: str) -> str:
    steps_path = path + ".steps"
    if not os.path.exists(steps_path) and path.endswith(".jsonl"):
        steps_path = path[:-len(".jsonl")] + ".steps.jsonl"  # as kept in docs/results/real/composition
    with open(steps_path) as f:
        steps = [e for e in map(json.loads, f) if e.get("e") == "step"]
    with open(path) as f:
        reads = [r for r in map(json.loads, f) if r.get("group") and r.get("workers")]
    reads = reads[len(reads) // 3:]
    late = [e["dt"] for e in steps[20:]] or [e["dt"] for e in steps]
    median = statistics.median(late)
    files = [r["group"]["active_file"] + r["group"]["inactive_file"] for r in reads]
    return "%s: batch %d, %d steps, %.2f s a step (median past step 20), %.0f samples/s; file pages %d-%d MiB " \
        "(min, median); group usage up to %d MiB" % (
            os.path.basename(path), steps[0]["batch"], len(steps), median, steps[0]["batch"] / median,
            min(files), statistics.median(files), max(r["group"]["usage"] for r in reads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="workers-2g", choices=sorted(realjobs.ROWS))
    parser.add_argument("--batch", type=int)
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--out")
    parser.add_argument("--switch-from", type=int, help="run the first --switch-after steps at this batch")
    parser.add_argument("--switch-after", type=int, default=0)
    parser.add_argument("--with-session", action="store_true", help="the job talks to memd (MEMD_ENDPOINT) too")
    parser.add_argument("--summarize", nargs="+", metavar="FILE", help="summarize runs logged before")
    args = parser.parse_args()
    if args.summarize:
        for path in args.summarize:
            print(summarize(path))
        return
    if args.batch is None or args.out is None:
        parser.error("--batch and --out are needed to run a job")
    row = realjobs.ROWS[args.row]
    cmd = [sys.executable, realjobs.JOB, "--shape", row.shape, "--workers", str(row.workers), "--method", "fixed",
           "--batch", str(args.batch), "--steps", str(args.steps), "--steady-heap"]
    if args.with_session:
        cmd += ["--with-session"]
    if args.switch_from:
        cmd += ["--switch-from", str(args.switch_from), "--switch-after", str(args.switch_after)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([realjobs.ROOT, os.path.join(realjobs.ROOT, "client")]))
    with realjobs.MemoryCgroup(row.limit_bytes) as cg, open(args.out, "w") as log, \
            open(args.out + ".steps", "w") as steps:
        proc = subprocess.Popen(cmd, stdout=steps, stderr=subprocess.DEVNULL, env=env, preexec_fn=cg.join)
        started = time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            log.write(json.dumps(read(proc.pid, cg.path, started)) + "\n")
            log.flush()
        print("exit %s, killed %s, group peak %d MiB" % (proc.returncode, cg.oom_kills() > 0, cg.peak_bytes() >> 20))


if __name__ == "__main__":
    main()

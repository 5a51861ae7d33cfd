"""What a job at a fixed batch holds, read every half second, in a fresh memory cgroup of a row's size.

    sudo .venv/bin/python bench/composition.py --row workers-2g --batch 138 --steps 180 --out FILE

Runs bench/trainjob.py --method fixed (with memd's steady heap) and writes one JSON line per read:
the trainer's VmRSS, RssAnon, RssFile, RssShmem and VmHWM (/proc/PID/status), each worker's private
pages (/proc/PID/smaps_rollup) and the group's memory.stat (v1: cache, rss, shmem, mapped_file,
active_file, inactive_file) with its usage, in MiB; the job's own step events go to FILE.steps.
It shows what the kernel takes back before it kills: near the limit the group's file pages and the
trainer's library pages shrink while the job runs on (docs/results.md, the workers row).

With ``--method loader --workers W --prefetch P`` the job is MemdLoader's at a fixed plan (batch,
W workers at prefetch P, no daemon): what the loader's batch is judged against, its batches held
and its workers forked as the loader holds and forks them. ``--workers``, ``--prefetch`` and
``--freeze`` (``gc.freeze`` before the fork, as MemdLoader does) run the plain loader that way.

    .venv/bin/python bench/composition.py --summarize FILE...

prints, for runs already logged, the median seconds a step took past the first 20 steps (where the
workers have copied most of what they will), samples a second at that median, and the group's file
pages (min and median over the last two thirds of the reads): a batch that runs only by evicting
the pages its job maps is slow, not killed.

A job whose workers copy what they read keeps growing long after a short probe ends, and at the
group's limit it may run on by evicting and reading back its own code's pages (9-13 s a step
instead of 0.5: not killed, but no longer training). Whether a batch fits a run as long as memd's
is told by runs as long, one verdict each:

    .venv/bin/python bench/composition.py --record workers-2g [--beside WORKERS] FILE...

reads each run's steps (FILE.steps or FILE.steps.jsonl[.gz]): it *ran* (every step, the last
ones as fast as the first), *thrashed* (a stretch of THRASH_WINDOW steps whose median took
THRASH times the run's usual step) or *ended early* (killed, or stopped); and writes the row's
``long`` feasible into docs/results/real/results.json: the largest batch whose runs (MIN_RUNS at
least) all ran, every batch probed below it running too. The table then judges the row's methods
against it (``--replot``); until one is known the cell says what is (below the smallest batch that
failed) and the methods stay judged against the short probes. With ``--beside WORKERS`` the runs
are of the loader's job beside the workers it chose, and the long feasible is the loader's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import realjobs  # noqa: E402
from bench.reads import opened, read  # noqa: E402


def _load(name: str) -> List[Dict]:
    """The JSON lines of a log, kept plain or gzipped."""
    with opened(name) as f:
        return [json.loads(line) for line in f if line.strip()]


def _events(path: str) -> List[Dict]:
    """The job's step events logged beside the reads in ``path``: FILE.steps as written, or
    FILE.steps.jsonl[.gz] as kept in docs/results/real/composition."""
    for candidate in (path + ".steps", path.replace(".jsonl", ".steps.jsonl")):
        for name in (candidate, candidate + ".gz"):
            if os.path.exists(name):
                return _load(name)
    raise SystemExit("composition: no steps logged beside %s" % path)


def summarize(path: str) -> str:
    steps = [e for e in _events(path) if e.get("e") == "step"]
    reads = [r for r in _load(path) if r.get("group") and r.get("workers")]
    reads = reads[len(reads) // 3:]
    late = [e["dt"] for e in steps[20:]] or [e["dt"] for e in steps]
    median = statistics.median(late)
    files = [r["group"]["active_file"] + r["group"]["inactive_file"] for r in reads]
    path_to = "" if steps[0]["batch"] == steps[-1]["batch"] else " (from %d)" % steps[0]["batch"]
    return "%s: batch %d%s, %d steps, %.2f s a step (median past step 20), %.0f samples/s; file pages %d-%d MiB " \
        "(min, median); group usage up to %d MiB" % (
            os.path.basename(path), steps[-1]["batch"], path_to, len(steps), median, steps[-1]["batch"] / median,
            min(files), statistics.median(files), max(r["group"]["usage"] for r in reads))


THRASH, THRASH_WINDOW = 3.0, 20  # steps this many times slower, this many in a row: thrashing
USUAL = (20, 220)  # the steps that say how long a step usually takes: past the workers' first copying


def verdict(steps: List[Dict], ended: bool) -> Dict:
    """One run's outcome from its step events (each with ``dt``, in seconds), and whether it
    reached its end: ran, thrashed (from which step) or ended early (at which step)."""
    dts = [e["dt"] for e in steps]
    usual = statistics.median(dts[USUAL[0]:USUAL[1]] or dts or [0.0])
    for at in range(USUAL[0], len(dts) - THRASH_WINDOW + 1):
        if statistics.median(dts[at:at + THRASH_WINDOW]) > THRASH * usual:
            first = next(i for i in range(at, len(dts)) if dts[i] > THRASH * usual)
            return {"outcome": "thrashed", "at_step": first, "usual_seconds": usual}
    if not ended:
        return {"outcome": "ended early", "at_step": len(dts), "usual_seconds": usual}
    return {"outcome": "ran", "at_step": len(dts), "usual_seconds": usual}


MIN_RUNS = 3  # runs a batch must have, all run, to count: 129 ran twice, then was killed at step 222


def long_feasible(probes: List[Dict]) -> Optional[int]:
    """The largest batch whose runs, MIN_RUNS of them at least, all ran, every batch probed below
    it having run too; None when none is (then it is below the smallest that failed)."""
    best = None
    for batch in sorted({p["batch"] for p in probes}):
        runs = [p for p in probes if p["batch"] == batch]
        if not all(p["outcome"] == "ran" for p in runs):
            break
        if len(runs) >= MIN_RUNS:
            best = batch
    return best


def record(row: str, paths: List[str], results: str, beside: Optional[int] = None) -> None:
    """Each run's verdict, and the row's long feasible written into ``results``; with ``beside``,
    the long feasible beside the workers its loader chose (runs with --workers BESIDE), which the
    loader's batch is judged against."""
    probes = []
    for path in paths:
        events = _events(path)
        steps = [e for e in events if e.get("e") == "step"]
        if not steps:
            raise SystemExit("composition: %s took no step" % path)
        if len({e["batch"] for e in steps}) > 1:  # --switch-from, --schedule: an adaptive path, not a probe
            raise SystemExit("composition: %s changed its batch; only runs at one batch are probes of it" % path)
        if beside is not None:
            workers = max(len(r.get("workers") or []) for r in _load(path))
            if workers != beside:
                raise SystemExit("composition: %s ran %d workers, not %d" % (path, workers, beside))
        probe = dict(batch=steps[0]["batch"], steps=len(steps), file=os.path.basename(path),
                     **verdict(steps, any(e.get("e") == "end" for e in events)))
        probes.append(probe)
        print("%(file)s: batch %(batch)d, %(steps)d steps: %(outcome)s (step %(at_step)d; "
              "usually %(usual_seconds).2f s a step)" % probe)
    with open(results) as f:
        data = json.load(f)
    result = next(r for r in data["results"] if r["row"]["name"] == row)
    best = long_feasible(probes)
    ran = [p for p in probes if p["outcome"] == "ran"]
    failed = [p["batch"] for p in probes if p["outcome"] != "ran"]
    long = {"batch": best, "below": min(failed) if best is None and failed else None,
            "steps": max(p["steps"] for p in (ran or probes)), "probes": sorted(probes, key=lambda p: p["batch"])}
    if beside is None:
        found = result["feasible"]
        found["long"] = long
        # Judged against the long feasible once one is known; until then (a failure at the smallest
        # batch probed, or too few runs below it) the short probes' batch stays.
        found["batch"] = realjobs.judged(max(found["plain"]["batch"], found["steady"]["batch"]), long)
    else:
        check = result.get("workers_check")
        if not check or check["loader_workers"] != beside:
            raise SystemExit("composition: %s's loader did not choose %d workers" % (row, beside))
        check["feasible_beside_chosen"]["long"] = long
    with open(results, "w") as f:
        json.dump(data, f, indent=1)
    print("%s: the long feasible%s is %s" % (
        row, "" if beside is None else " beside %d worker%s" % (beside, "" if beside == 1 else "s"),
        realjobs.long_known(long)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="workers-2g", choices=sorted(realjobs.ROWS))
    parser.add_argument("--batch", type=int)
    parser.add_argument("--steps", type=int, default=180)
    parser.add_argument("--out")
    parser.add_argument("--switch-from", type=int, help="run the first --switch-after steps at this batch")
    parser.add_argument("--switch-after", type=int, default=0)
    parser.add_argument("--schedule", help="BATCH:STEPS,... run in turn before --batch (an adaptive method's path)")
    parser.add_argument("--method", choices=("fixed", "loader"), default="fixed",
                        help="loader: MemdLoader at --batch, the loader's own job at one batch")
    parser.add_argument("--workers", type=int, help="DataLoader workers (the row's unless given)")
    parser.add_argument("--prefetch", type=int, help="each worker's prefetch_factor (torch's 2 unless given)")
    parser.add_argument("--freeze", action="store_true", help="freeze the collected objects before forking workers, "
                                                               "as MemdLoader does")
    parser.add_argument("--with-session", action="store_true", help="the job talks to memd (MEMD_ENDPOINT) too")
    parser.add_argument("--summarize", nargs="+", metavar="FILE", help="summarize runs logged before")
    parser.add_argument("--record", metavar="ROW", help="with FILE...: each run's verdict, and ROW's long feasible "
                                                         "written into --results")
    parser.add_argument("--beside", type=int, metavar="WORKERS",
                        help="with --record: the runs are beside the WORKERS the row's loader chose")
    parser.add_argument("files", nargs="*", metavar="FILE")
    parser.add_argument("--results", default=os.path.join(realjobs.ROOT, "docs", "results", "real", "results.json"))
    args = parser.parse_args()
    if args.record:
        record(args.record, args.files, args.results, args.beside)
        return
    if args.summarize:
        for path in args.summarize:
            print(summarize(path))
        return
    if args.batch is None or args.out is None:
        parser.error("--batch and --out are needed to run a job")
    row = realjobs.ROWS[args.row]
    if args.workers is not None:
        row = replace(row, workers=args.workers)
    cmd = [sys.executable, realjobs.JOB, "--shape", row.shape, "--workers", str(row.workers), "--method", args.method,
           "--batch", str(args.batch), "--steps", str(args.steps), "--steady-heap"]
    if args.prefetch:
        cmd += ["--prefetch", str(args.prefetch)]
    if args.freeze:
        cmd += ["--freeze"]
    if args.with_session:
        cmd += ["--with-session"]
    if args.switch_from:
        cmd += ["--switch-from", str(args.switch_from), "--switch-after", str(args.switch_after)]
    if args.schedule:
        cmd += ["--schedule", args.schedule]
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

"""How fast a real job trains at the batches just below the kill line of its cgroup.

    sudo .venv/bin/python bench/edgespeed.py --row two-workers-2g --batches 560,592,611,630,648 \
        [--steps 120] [--repeats 2] [--drop-caches] [--feasible 648] [--out DIR]

"Feasible" in bench/realjobs.py is the largest batch the kernel does not kill. Near that line the
kernel keeps the job alive by reclaiming the group's page cache; where that holds the pages of
the code the job runs, the job reads them back from disk at every step. This runs the row's job
at each batch (a fixed batch, glibc's heap held steady as memd's client holds it: realjobs'
--steady-heap probes), each in a fresh process in a fresh cgroup of the row's size, the batches
interleaved across repeats so a noisy moment of the machine does not land on one batch, and
reports per batch:

- seconds per step, the median over the second half of the steps (the first half holds the
  imports, the warm-up and the workers' first copies);
- samples per second (batch / that median), and its ratio to the smallest batch's in the same run;
- the group's major page faults and file refaults (pages read again after reclaim dropped them)
  per step over the same half, and the fewest file pages charged to it, all and mapped ones
  (memory.stat, v1; v1's mapped_file counts mapped shared memory too; pages another group was
  charged for first are not counted);
- kills by the kernel's OOM killer.

Where a page is charged depends on who read it first: run after run from one virtualenv, the
libraries' page cache stays charged to the group of the run that first read it (or its parent),
and each new job's group holds none of it. ``--drop-caches`` drops the machine's clean page cache
before each run (as root), so the job reads its libraries itself and they are charged to its
group, as in a fresh container: then the kernel can take the job's own code pages at its limit.

Everything here is measured; nothing comes from memd. Writes DIR/results.json and DIR/table.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

from bench.memcg import available  # noqa: E402
from bench.realjobs import ROWS, Row, machine_meta, run_job, settled_steps  # noqa: E402


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")


def measure(row: Row, batch: int, steps: int, reads_path: str, fresh_cache: bool = False) -> Dict:
    n = settled_steps(row, batch, steps)
    if fresh_cache:
        drop_caches()
    run = run_job(row, "fixed", n, None, ["--method", "fixed", "--batch", str(batch), "--steady-heap"],
                  reads=reads_path)
    out: Dict = {"batch": batch, "steps": len(run.batches), "killed": run.killed, "exit_code": run.exit_code,
                 "wall_seconds": run.wall_seconds, "dropped_caches": fresh_cache}
    if not run.completed or len(run.seconds) < 4:
        return out
    half = len(run.seconds) // 2
    gaps = [b - a for a, b in zip(run.seconds[half - 1:], run.seconds[half:])]
    per_step = statistics.median(gaps)
    out.update(seconds_per_step=round(per_step, 4), samples_per_second=round(batch / per_step, 1))
    with open(reads_path) as f:
        reads = [json.loads(line) for line in f]
    # The second half of the steps, by the clock the reads share with the steps (both since start,
    # the reads' a little later: the reader starts after the process).
    start, end = run.seconds[half - 1], run.seconds[-1]
    late = [r for r in reads if start <= r["t"] <= end and r.get("trainer") and "pgmajfault" in r.get("group", {})]
    if len(late) >= 2:
        first, last = late[0]["group"], late[-1]["group"]
        done = len(run.seconds) - half
        out["major_faults_per_step"] = round((last["pgmajfault"] - first["pgmajfault"]) / done, 1)
        out["file_refaults_per_step"] = round(
            (last["workingset_refault_file"] - first["workingset_refault_file"]) / done, 1)
        out["mapped_file_min_mib"] = min(r["group"].get("mapped_file", 0) for r in late)
        out["file_lru_min_mib"] = min(r["group"].get("active_file", 0) + r["group"].get("inactive_file", 0)
                                      for r in late)
    return out


def summarize(runs: List[Dict]) -> List[Dict]:
    """Per batch: medians over its completed repeats; the ratio against the smallest batch."""
    rows = []
    for batch in sorted({r["batch"] for r in runs}):
        mine = [r for r in runs if r["batch"] == batch]
        done = [r for r in mine if "seconds_per_step" in r]

        def med(key: str, done: List[Dict] = done) -> Optional[float]:
            values = [r[key] for r in done if key in r]
            return round(statistics.median(values), 4) if values else None

        rows.append({"batch": batch, "runs": len(mine), "killed": sum(r["killed"] for r in mine),
                     "seconds_per_step": med("seconds_per_step"), "samples_per_second": med("samples_per_second"),
                     "major_faults_per_step": med("major_faults_per_step"),
                     "file_refaults_per_step": med("file_refaults_per_step"),
                     "mapped_file_min_mib": med("mapped_file_min_mib"),
                     "file_lru_min_mib": med("file_lru_min_mib")})
    base = next((r["samples_per_second"] for r in rows if r["samples_per_second"]), None)
    for r in rows:
        r["speed_vs_smallest"] = round(r["samples_per_second"] / base, 3) if base and r["samples_per_second"] else None
    return rows


def table(rows: List[Dict], feasible: Optional[int]) -> str:
    lines = ["| batch | of feasible | runs | killed | s/step (median) | samples/s | vs %d | major faults/step | "
             "file refaults/step | file pages, fewest (MiB) | mapped, fewest (MiB) |" % rows[0]["batch"],
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(v, fmt="%s") -> str:
        return "-" if v is None else fmt % v

    for r in rows:
        lines.append("| %d | %s | %d | %d | %s | %s | %s | %s | %s | %s | %s |" % (
            r["batch"], "%.1f %%" % (100 * r["batch"] / feasible) if feasible else "-", r["runs"], r["killed"],
            cell(r["seconds_per_step"], "%.3f"), cell(r["samples_per_second"], "%.0f"),
            cell(r["speed_vs_smallest"], "%.2f"), cell(r["major_faults_per_step"], "%.0f"),
            cell(r["file_refaults_per_step"], "%.0f"), cell(r.get("file_lru_min_mib"), "%.0f"),
            cell(r["mapped_file_min_mib"], "%.0f")))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--row", required=True, choices=sorted(ROWS))
    parser.add_argument("--batches", required=True, help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--feasible", type=int, default=None, help="the row's feasible batch, for the table")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the machine's clean page cache before each run (root): the job's libraries "
                             "are then charged to its own group")
    parser.add_argument("--out", default="edgespeed-out")
    args = parser.parse_args(argv)
    why = available()
    if why is not None:
        print("cannot run: %s" % why, file=sys.stderr)
        return 2
    if args.drop_caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        print("cannot run: --drop-caches writes /proc/sys/vm/drop_caches, which needs root", file=sys.stderr)
        return 2
    row = ROWS[args.row]
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    os.makedirs(os.path.join(args.out, "reads"), exist_ok=True)
    runs = []
    for repeat in range(args.repeats):
        for batch in (batches if repeat % 2 == 0 else batches[::-1]):
            result = measure(row, batch, args.steps, os.path.join(args.out, "reads", "%d-%d.jsonl" % (batch, repeat)),
                             args.drop_caches)
            runs.append(result)
            print(json.dumps(result), flush=True)
    rows = summarize(runs)
    meta = dict(command=" ".join(["python", "bench/edgespeed.py"] + (argv if argv is not None else sys.argv[1:])),
                **machine_meta(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "row": row.name, "runs": runs, "batches": rows}, f, indent=1)
    text = table(rows, args.feasible)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

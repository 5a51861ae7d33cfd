"""What holding glibc's heap steady (memd.client.heap.steady_heap) costs a step, and what it
saves: the same real job at the same batch in the same cgroup, plain and steady in turn.

    sudo .venv/bin/python bench/heapcost.py [--jobs cnn:560,gpt:40] [--rounds 3] [--steps 12]

Each round runs every job twice, plain and steady, in alternating order (the machine is shared:
a ratio taken within a round is what counts). Per job and mode: the median step time (steps
after the first two), and the range of the process's VmHWM over those steps, each step's
high-water mark reset before it (bench/trainjob.py --method fixed). Prints a markdown table and
writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from bench.realjobs import GiB, Row, run_job  # noqa: E402

MiB = 2 ** 20
SKIP = 2  # a job's first steps allocate the optimizer's state and meet new sizes


def measure(shape: str, batch: int, steps: int, limit: int, steady: bool) -> dict:
    row = Row("heapcost-%s" % shape, shape, limit, batch)
    run = run_job(row, "fixed", steps, None, ["--method", "fixed", "--batch", str(batch)] + (
        ["--steady-heap"] if steady else []))
    if not run.completed:
        raise SystemExit("heapcost: %s at %d (%s heap) did not complete: %s" % (
            shape, batch, "steady" if steady else "plain", "killed" if run.killed else "exit %s" % run.exit_code))
    dts = [b - a for a, b in zip(run.seconds[SKIP:], run.seconds[SKIP + 1:])]
    hwm = run.hwm[SKIP:]
    return {"step_seconds": statistics.median(dts), "hwm_min": min(hwm), "hwm_max": max(hwm),
            "hwm_median": statistics.median(hwm)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", default="cnn:560,gpt:40", help="shape:batch,... (bench/trainjob.py shapes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--limit-gib", type=float, default=1.5, help="the cgroup each run gets")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "heap.json"))
    args = parser.parse_args(argv)
    jobs = [(shape, int(batch)) for shape, _, batch in (j.partition(":") for j in args.jobs.split(","))]
    rounds = []
    for r in range(args.rounds):
        for shape, batch in jobs:
            modes = (False, True) if r % 2 == 0 else (True, False)
            got = {("steady" if steady else "plain"): measure(shape, batch, args.steps, int(args.limit_gib * GiB), steady)
                   for steady in modes}
            rounds.append({"round": r, "shape": shape, "batch": batch, **got})
            print("round %d %s:%d  plain %.3f s, VmHWM %.0f-%.0f MiB | steady %.3f s, VmHWM %.0f-%.0f MiB" % (
                r, shape, batch, got["plain"]["step_seconds"], got["plain"]["hwm_min"] / MiB,
                got["plain"]["hwm_max"] / MiB, got["steady"]["step_seconds"], got["steady"]["hwm_min"] / MiB,
                got["steady"]["hwm_max"] / MiB), flush=True)
    lines = ["| job | step time, steady / plain (median of rounds) | VmHWM plain (min-max, MiB) | VmHWM steady (min-max, MiB) |",
             "|---|---|---|---|"]
    for shape, batch in jobs:
        mine = [x for x in rounds if x["shape"] == shape]
        ratio = statistics.median(x["steady"]["step_seconds"] / x["plain"]["step_seconds"] for x in mine)
        span = lambda mode: "%.0f-%.0f" % (min(x[mode]["hwm_min"] for x in mine) / MiB,  # noqa: E731
                                           max(x[mode]["hwm_max"] for x in mine) / MiB)
        lines.append("| %s at batch %d | %.3f | %s | %s |" % (shape, batch, ratio, span("plain"), span("steady")))
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python bench/heapcost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "limit_gib": args.limit_gib, "steps": args.steps, "rounds": rounds, "table": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

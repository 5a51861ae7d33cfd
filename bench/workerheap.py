"""What a loader worker's C heap holds, and what its batches cost, with the mmap threshold memd's
client sets in the processes a Session's process forks (memd.client.heap.WORKER_MMAP_THRESHOLD)
and with the parent's 128 KiB: the workers shape's own DataLoader, its batches pulled and no
step trained (the workers' rate, the worst case for the threshold), in fresh processes in turn.

    .venv/bin/python bench/workerheap.py [--workers 2] [--batch 120] [--batches 300] [--rounds 3]

Each round runs both arms, in alternating order (the machine is shared: a ratio taken within a
round is what counts). Per arm: the median seconds a batch (after the batches of the first
pass over the records), and at the end each worker's private pages in its C heap (``[heap]`` in
/proc/PID/smaps) and elsewhere. Prints a markdown table and writes JSON (--out).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def private(pid: int) -> tuple:
    """(MiB private in the C heap, MiB private elsewhere) of one process."""
    from bench.reads import smaps_private

    heap, rest = smaps_private(pid)
    return round(heap / 1024, 1), round(rest / 1024, 1)


def arm(args) -> None:
    """One arm in this process: a Session's steady heap, and for 'parent' the children put back
    to the parent's threshold."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]
    from memd.client import heap
    if not heap.steady_heap():
        raise SystemExit("workerheap: glibc's mallopt is not here (or MEMD_STEADY_HEAP=0)")
    if args.arm == "parent":  # runs after memd's own hook: the child goes back to the parent's threshold
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        os.register_at_fork(after_in_child=lambda: mallopt(M_MMAP_THRESHOLD, heap.STEADY_MMAP_THRESHOLD))
    from bench import reads, trainjob
    shape = trainjob.Shape("workers", args.workers)
    first_pass = len(shape.records.rows) // args.batch + 1
    seconds = []
    for i in range(args.batches):
        started = time.perf_counter()
        shape.sample(args.batch)
        if i >= first_pass:
            seconds.append(time.perf_counter() - started)
    workers = [private(pid) for pid in reads.children(os.getpid())]
    print(json.dumps({"arm": args.arm, "batch_seconds": statistics.median(seconds), "workers": workers}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=120)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON of every arm's round")
    parser.add_argument("--arm", choices=("parent", "memd"), help=argparse.SUPPRESS)  # one arm, in this process
    args = parser.parse_args()
    if args.arm:
        arm(args)
        return
    runs = []
    for r in range(args.rounds):
        for name in (("parent", "memd") if r % 2 == 0 else ("memd", "parent")):
            out = subprocess.run([sys.executable, "-W", "ignore", os.path.abspath(__file__), "--arm", name,
                                  "--workers", str(args.workers), "--batch", str(args.batch),
                                  "--batches", str(args.batches)], capture_output=True, text=True, check=True)
            run = dict(json.loads(out.stdout.strip().splitlines()[-1]), round=r)
            runs.append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
    print("| arm | seconds a batch (median of rounds) | ratio to parent's, per round | worker's C heap, MiB "
          "| worker's other private pages, MiB |")
    print("|---|---|---|---|---|")
    by = {name: [x for x in runs if x["arm"] == name] for name in ("parent", "memd")}
    for name, label in (("parent", "128 KiB (the parent's)"), ("memd", "16 KiB (memd's, in a forked child)")):
        ratios = [x["batch_seconds"] / p["batch_seconds"] for x, p in zip(by[name], by["parent"])]
        heaps = [h for x in by[name] for h, _ in x["workers"]]
        rests = [o for x in by[name] for _, o in x["workers"]]
        print("| %s | %.4f | %s | %.1f-%.1f | %.1f-%.1f |" % (
            label, statistics.median(x["batch_seconds"] for x in by[name]), ", ".join("%.3f" % q for q in ratios),
            min(heaps), max(heaps), min(rests), max(rests)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()

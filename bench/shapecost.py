"""What a batch size a CPU trainer has not run before costs it: one process of the four-workers
job (bench/trainjob.py's ``workers`` shape, its loader rebuilt at each change, its heap held and
trimmed at each change as memd's client does) runs a schedule of batch sizes, and after each
stay prints the trainer's anonymous memory and its steps' peaks (VmHWM, reset before each step)
over the stay's second half.

    .venv/bin/python bench/shapecost.py --batches 126,123,121,119,117,115,113,111,109 \\
        --steps 40 --last 160
    .venv/bin/python bench/shapecost.py --batches 109 --last 160      # the same batch, fresh
    .venv/bin/python bench/shapecost.py --batches 120,120,120,120,120,120 --rebuild --steps 400 \
        --last 400      # a new loader (four fresh workers) at each stay, the batch the same

With ``--rebuild`` each stay starts a new loader even at the same batch, and its line adds what
each of the loader's workers holds of its own (smaps_rollup's private pages) over the stay's
last quarter: whether a rebuild alone, with no new size, leaves the next workers dearer.

No cgroup: host memory, nothing near a limit; the schedule and the environment are the only
differences between runs (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`` turns oneDNN's per-shape cache
off). One JSON line per stay, MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "bench"), os.path.join(ROOT, "client")]

import reads  # noqa: E402
import trainjob  # noqa: E402

from memd.client.heap import steady_heap, trim_heap  # noqa: E402

MiB = 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", required=True, help="comma-separated batch sizes, one stay each")
    parser.add_argument("--steps", type=int, default=40, help="steps of each stay but the last")
    parser.add_argument("--last", type=int, default=160, help="steps of the last stay")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rebuild", action="store_true", help="a new loader at every stay, the batch the same or not")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    steady_heap()
    shape = trainjob.Shape("workers", args.workers)
    for k, batch in enumerate(batches):
        if k and (batch != batches[k - 1] or args.rebuild):
            if args.rebuild:
                shape.loader = shape.batches = None  # its workers end as the loader goes
            trim_heap()
        steps = args.last if k == len(batches) - 1 else args.steps
        anon, peaks, held = [], [], []
        for i in range(steps):
            trainjob.reset_hwm()
            shape.step(batch)
            peaks.append(trainjob.vm_hwm())
            anon.append(trainjob.status_bytes("RssAnon:"))
            if args.rebuild and i >= steps * 3 // 4:
                held.append(sorted(reads.status(pid).get("private", 0) for pid in reads.children(os.getpid())))
        half = slice(steps // 2, None)
        line = {"stay": k, "batch": batch, "anon_median": statistics.median(anon[half]) / MiB,
                "anon_most": max(anon[half]) / MiB, "peak_median": statistics.median(peaks[half]) / MiB,
                "peak_most": max(peaks[half]) / MiB,
                "onednn_cache": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "default")}
        if held:  # each worker's median over the last quarter, MiB
            line["workers_private"] = [statistics.median(w[j] for w in held if len(w) > j)
                                       for j in range(len(held[-1]))]
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()

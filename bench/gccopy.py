"""What one full collection by Python's cycle collector in the trainer copies of the pages a
forked DataLoader worker shares with it, with the trainer's objects frozen before the fork (as
MemdLoader does, gc.freeze) and without: the workers shape's dataset (bench/trainjob.py, 1,200
records kept as Python lists) behind a DataLoader with one persistent worker, which first reads
every record (an epoch), in a fresh process per arm.

    .venv/bin/python bench/gccopy.py [--rounds 3]

Per arm and round: the worker's and the trainer's own memory (USS, smaps_rollup) before and
after ``gc.collect()`` in the trainer, and the seconds the collection took. A page either process
writes to is copied; what both then hold alone is memory the job's group did not use before.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARM = r"""
import gc, json, os, sys, time
sys.path[:0] = [os.path.join(ROOT, "bench"), os.path.join(ROOT, "client")]
import torch
import trainjob
from memd.client.heap import steady_heap
from reads import status

def own(pid):  # MiB it alone maps (USS), as bench/reads.py reads it
    return status(pid)["private"]

steady_heap()
shape = trainjob.Shape("workers", workers=1)
if FROZEN:
    gc.collect()
    gc.freeze()
loader = torch.utils.data.DataLoader(shape.records, batch_size=256, sampler=trainjob.passes(shape.records),
                                     num_workers=1, prefetch_factor=1, persistent_workers=True)
batches = iter(loader)
for _ in range(len(loader)):  # an epoch: the worker reads every record
    next(batches)
worker = batches._workers[0].pid
time.sleep(1)
before = own(worker), own(os.getpid())
started = time.monotonic()
gc.collect()
seconds = time.monotonic() - started
time.sleep(0.5)
after = own(worker), own(os.getpid())
print(json.dumps({"frozen": FROZEN, "worker_before": before[0], "worker_after": after[0],
                  "trainer_before": before[1], "trainer_after": after[1], "seconds": seconds}))
"""


def arm(frozen: bool) -> dict:
    code = "ROOT = %r\nFROZEN = %r\n" % (ROOT, frozen) + ARM
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print("| round | objects | worker's own MiB, before -> after | trainer's own MiB, before -> after | collection s |")
    print("|---|---|---|---|---|")
    for i in range(args.rounds):
        for frozen in ((False, True) if i % 2 == 0 else (True, False)):
            r = arm(frozen)
            print("| %d | %s | %d -> %d | %d -> %d | %.2f |" % (
                i + 1, "frozen" if frozen else "as they are", r["worker_before"], r["worker_after"],
                r["trainer_before"], r["trainer_after"], r["seconds"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

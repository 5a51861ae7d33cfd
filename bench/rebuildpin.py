"""What a MemdLoader rebuild leaves pinned: its new workers are forked while the trainer still holds
the batch delivered last, and a fork inherits the trainer's descriptor (and mapping) of that
batch's shared memory, so the batch stays in memory as long as the new workers live, however soon
the trainer lets go of it.

    .venv/bin/python bench/rebuildpin.py [--batch 300 --then 100]

Per arm, in a fresh process: MemdLoader with one worker at prefetch 1 over samples of 100 KiB, its
plan fixed by a script (no daemon): ``--then`` throughout (no rebuild), or ``--batch`` for four
batches and then ``--then`` (a cut of more than a tenth: a rebuild), the loop holding each batch
until the next (``for batch in loader``) or dropping it before asking for the next. After ten
batches at ``--then``: the torch shared-memory files the live worker holds open that another
process made (inherited, not its own), and their MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def inherited(pid: int) -> List[str]:
    """The torch shared-memory files ``pid`` holds open that another process made (torch names
    them torch_<maker's pid>_...), as /proc/PID/fd/N paths: batches it was forked holding."""
    found = []
    for fd in os.listdir("/proc/%d/fd" % pid):
        path = "/proc/%d/fd/%s" % (pid, fd)
        try:
            name = os.path.basename(os.readlink(path))
        except OSError:
            continue
        if name.startswith("torch_") and name.split("_")[1] != str(pid):
            found.append(path)
    return found


ARM = r"""
import json, os, sys
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]
import torch
from bench.rebuildpin import inherited
from memd import client
from memd.client.training import MemdLoader

class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        return torch.full((25_600,), float(i))  # 100 KiB

class Script:  # plans from a list, one a batch: a stand-in for the daemon
    target_effective_batch, min_batch = None, 1

    def __init__(self, sizes):
        self.sizes, self.asked = sizes, 0

    def plan(self):
        size = self.sizes[min(self.asked, len(self.sizes) - 1)]
        self.asked += 1
        return client.Plan(batch_size=size, grad_accum_steps=1, effective_batch_size=size, num_workers=1,
                           prefetch_factor=1, throttle=False, pressure="ok", reason="script", source="script")

sizes = ([BEFORE] * 4 if BEFORE else []) + [THEN] * 10
loader = MemdLoader(Samples(), Script(sizes), report=False)
for k, batch in enumerate(loader):
    if DROP:
        del batch
    if k == len(sizes) - 1:
        break
worker = [int(p) for p in os.listdir("/proc") if p.isdigit() and open("/proc/%s/stat" % p).read().split()[3]
          == str(os.getpid())]
files = [os.path.getsize(path) for pid in worker for path in inherited(pid)]
print(json.dumps({"builds": loader.builds, "workers": len(worker), "inherited_files": len(files),
                  "inherited_mib": round(sum(files) / 2**20, 1)}))
"""


def arm(before: int, then: int, drop: bool) -> dict:
    code = ARM.replace("ROOT", repr(ROOT)).replace("BEFORE", str(before)).replace("THEN", str(then)) \
        .replace("DROP", str(drop))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=300, help="the batch before the cut")
    parser.add_argument("--then", type=int, default=100, help="the batch after it")
    args = parser.parse_args(argv)
    print("one worker, prefetch 1, samples of 100 KiB: a batch of %d is %.1f MiB, of %d %.1f MiB" % (
        args.batch, args.batch * 100 / 1024, args.then, args.then * 100 / 1024))
    for name, before, drop in (("no rebuild (%d throughout)" % args.then, 0, False),
                               ("rebuild %d -> %d, the loop holding its batch" % (args.batch, args.then), args.batch,
                                False),
                               ("rebuild %d -> %d, the loop dropping its batch" % (args.batch, args.then), args.batch,
                                True)):
        result = arm(before, args.then, drop)
        print("%-48s builds %d; the live worker holds %d inherited file(s), %.1f MiB" % (
            name, result["builds"], result["inherited_files"], result["inherited_mib"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

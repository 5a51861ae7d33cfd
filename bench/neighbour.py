"""How fast a neighbour may grow beside a job that runs at its edge for memd still to save the job.

    sudo .venv/bin/python bench/neighbour.py [--rates 25,50,100,200,400] [--steps-ms 100,1000]

A job (bench/examjob.py: 200 MiB fixed, 8 MiB a sample, `suggest_batch()` alone) in a 2 GiB group
grows to its edge (past its first steps' reserve); then another process of the group grows by
400 MiB at RATE MiB/s and holds it. Per step time and rate: whether the job survived (the
kernel's OOM-kill count of the group, and its exit), its batch before and after, and the time
from the growth's start to the job's first step at a smaller batch. Everything is measured:
batches the job ran, kills the kernel counted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

from bench.exam import JOB  # noqa: E402
from bench.memcg import MemoryCgroup  # noqa: E402
from bench.realjobs import MemdDaemon  # noqa: E402

MiB, GiB = 2 ** 20, 2 ** 30
SPEC = {"kind": "private", "fixed_mib": 200, "sample_kib": 8192}
GROWTH_MIB, BASE_MIB = 400, 50


def one(daemon: MemdDaemon, step_ms: int, rate: float, settle: float) -> dict:
    spec = dict(SPEC, step_ms=step_ms)
    growth = GROWTH_MIB / rate
    schedule = "0:%d,%.1f:%d,%.1f:%d" % (BASE_MIB, settle, BASE_MIB, settle + growth, BASE_MIB + GROWTH_MIB)
    seconds = settle + growth + max(10.0, 10 * step_ms / 1000)
    with MemoryCgroup(2 * GiB) as cg:
        near = subprocess.Popen([sys.executable, JOB, "--neighbour", schedule], preexec_fn=cg.join,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        job = subprocess.Popen([sys.executable, JOB, "--spec", json.dumps(spec), "--method", "suggest",
                                "--default-batch", "32", "--job", "neighbour-%d-%d" % (step_ms, rate),
                                "--steps", "100000", "--seconds", str(seconds)], preexec_fn=cg.join,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=dict(os.environ, MEMD_ENDPOINT=daemon.endpoint,
                                        PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "client")])))
        steps = []
        for line in job.stdout:
            if line.startswith('{"e": "step"'):
                steps.append((time.monotonic() - t0, json.loads(line)["batch"]))
        code = job.wait()
        near.kill()
        near.wait()
        kills = cg.oom_kills()
    start = settle + 1.0  # the neighbour starts about a second after the job (its own start-up)
    before = [b for t, b in steps if t < start]
    after = [(t, b) for t, b in steps if t >= start]
    edge = before[-1] if before else None
    cut = next((t - start for t, b in after if edge is not None and b < edge), None)
    return {"step_ms": step_ms, "rate_mib_s": rate, "killed": kills > 0 or code in (-9, 137), "batch_before": edge,
            "batch_after": steps[-1][1] if steps else None, "first_cut_after_s": None if cut is None else round(cut, 2),
            "steps": len(steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="25,50,100,200,400", help="MiB/s, comma-separated")
    ap.add_argument("--steps-ms", default="100,1000", help="the job's step times, comma-separated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    daemon = MemdDaemon()
    rows = []
    try:
        for step_ms in [int(s) for s in args.steps_ms.split(",")]:
            settle = max(15.0, 40 * step_ms / 1000)  # past its first 24 steps, at its edge
            for rate in [float(r) for r in args.rates.split(",")]:
                row = one(daemon, step_ms, rate, settle)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        daemon.stop()
    print("| step | neighbour grows | killed | batch before | after | first smaller step after the growth began |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| %d ms | %g MiB/s | %s | %s | %s | %s |" % (
            r["step_ms"], r["rate_mib_s"], "yes" if r["killed"] else "no", r["batch_before"], r["batch_after"],
            "-" if r["first_cut_after_s"] is None else "%.2f s" % r["first_cut_after_s"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

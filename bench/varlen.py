"""A job whose step memory depends on its input: memd asked for sequences, then for tokens.

    sudo .venv/bin/python bench/varlen.py [--seeds 1,2,3] [--methods suggest,report,helpers] [--steps 120]
                                          [--per-token] [--fixed 79]

The GPT-style job of bench/realjobs.py's gpt rows (bench/trainjob.py --shape gpt) in a real 1.5 GiB
memory cgroup, but each step's sequences are drawn 64, 128, 192 or 256 tokens long (probabilities
0.5, 0.3, 0.15, 0.05: length-bucketed batches, as a sampler grouping by length makes them), one
fresh process, cgroup and `memd serve` per run. memd learns what a step at each batch size costs;
asked for sequences, a step's cost at one batch size varies with a length it is not told (at
batch 92, twice as much at 192 tokens as at 64), and a longer step than any seen at the batch can
come at any time.

With --per-token, each method runs again asking memd for tokens instead of sequences: the batch
memd gives is a budget of tokens (its default 1024, four sequences of the longest) and each step
runs budget // length sequences of that step's length, so the unit memd plans in is the one the
job's memory follows.

Per run: whether the kernel killed it, the step and the batch and length it died at, and the
batch sizes memd gave before (with the lengths the job had run at each). Everything here is
measured (the jobs' own events, the kernel's kill count); nothing is taken from memd's status.
Writes DIR/results.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

from bench.memcg import available  # noqa: E402
from bench.realjobs import MemdDaemon, Row, machine_meta, run_job  # noqa: E402

GiB = 2 ** 30
LIMIT = 3 * GiB // 2
LENGTHS = "64:0.5,128:0.3,192:0.15,256:0.05"
LONGEST = 256


def run(method: str, seed: int, steps: int, lengths: str = LENGTHS, batch: int = 0, per_token: bool = False) -> Dict:
    """One job in a fresh cgroup (bench/realjobs.run_job) beside a fresh daemon (none for a fixed batch)."""
    row = Row("varlen-1.5g", "gpt", LIMIT, 4 * LONGEST if per_token else 4)
    extra = ["--method", method, "--lengths", lengths, "--seed", str(seed)]
    extra += (["--batch", str(batch), "--steady-heap"] if batch else []) + (["--per-token"] if per_token else [])
    daemon = MemdDaemon() if method != "fixed" else None
    try:
        job = run_job(row, method, steps, daemon.endpoint if daemon else None, extra)
    finally:
        if daemon:
            daemon.stop()
    return {"method": method, "seed": seed, "batch": batch or None, "per_token": per_token,
            "exit_code": job.exit_code, "killed": job.killed, "cgroup_peak_bytes": job.cgroup_peak_bytes,
            "seconds": job.wall_seconds, "steps": [list(step) for step in zip(job.batches, job.lengths, job.hwm)],
            "last_try": None if job.last_try is None else [job.last_try, job.last_length]}


def stays(steps: List[List[int]]) -> List[List]:
    """The batch sizes in turn, each with the set of lengths the job ran at it."""
    out: List[List] = []
    for batch, length, _ in steps:
        if not out or out[-1][0] != batch:
            out.append([batch, set()])
        out[-1][1].add(length)
    return out


def path(steps: List[List[int]]) -> str:
    """The batch sizes in turn, each with the lengths the job ran at it: '4 (64-192), 17 (64)'."""
    return ", ".join("%d (%s)" % (b, "-".join(str(n) for n in sorted(ls)) if len(ls) < 3 else
                                 "%d-%d" % (min(ls), max(ls))) for b, ls in stays(steps))


def budgets(steps: List[List[int]]) -> str:
    """The token budgets in turn: '1024, 2048, 4096'."""
    return ", ".join(str(b) for b, _ in stays(steps))


def table(runs: List[Dict], fits: int = 0) -> str:
    """``fits``: the tokens a step of the longest sequences fits (the fixed run's), for the share."""
    lines = ["| method | seed | outcome | batches memd gave (lengths run at each) |", "|---|---|---|---|"]
    for r in runs:
        unit = "budget %d" if r.get("per_token") else "batch %d"
        if r["killed"]:
            outcome = ("killed at step %d: " + unit + ", %d tokens") % (len(r["steps"]) + 1, *r["last_try"])
        elif r["exit_code"] == 0:
            outcome = "ran %d steps, none killed" % len(r["steps"])
            if r.get("per_token") and r["steps"]:
                last = r["steps"][-1][0]
                outcome += "; last budget %d tokens%s" % (last, " (%.1f %% of %d)" % (100.0 * last / fits, fits)
                                                          if fits else "")
        else:
            outcome = "failed (exit %s)" % r["exit_code"]
        name = r["method"] + (" %d, every step 256 tokens" % r["batch"] if r["batch"] else "") + \
            (", in tokens" if r.get("per_token") else "")
        lines.append("| %s | %d | %s | %s |" % (name, r["seed"], outcome,
                                               (budgets if r.get("per_token") else path)(r["steps"]) or "-"))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--methods", default="suggest,report,helpers")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--fixed", type=int, default=0,
                        help="also run this batch with every step at 256 tokens (what fits the longest)")
    parser.add_argument("--per-token", action="store_true",
                        help="also run each method asking memd for a budget of tokens")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "varlen"))
    args = parser.parse_args(argv)
    why = available()
    if why:
        print("varlen: %s" % why, file=sys.stderr)
        return 2
    runs = []
    fits = args.fixed * LONGEST
    for per_token in (False, True) if args.per_token else (False,):
        for seed in (int(s) for s in args.seeds.split(",")):
            for method in args.methods.split(","):
                runs.append(run(method, seed, args.steps, per_token=per_token))
                print(table(runs[-1:], fits).splitlines()[-1], flush=True)
    if args.fixed:
        runs.append(run("fixed", 0, 30, "%d:1" % LONGEST, args.fixed))
    os.makedirs(args.out, exist_ok=True)
    meta = dict(command="python bench/varlen.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                **machine_meta(), date=time.strftime("%Y-%m-%d"), lengths=LENGTHS, limit_bytes=LIMIT)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
    print(table(runs, fits))
    return 0


if __name__ == "__main__":
    sys.exit(main())

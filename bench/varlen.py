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
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

from bench.memcg import MemoryCgroup, available  # noqa: E402
from bench.realjobs import JOB, MemdDaemon, machine_meta  # noqa: E402

GiB = 2 ** 30
LIMIT = 3 * GiB // 2
LENGTHS = "64:0.5,128:0.3,192:0.15,256:0.05"
LONGEST = 256


def run(method: str, seed: int, steps: int, lengths: str = LENGTHS, batch: int = 0, per_token: bool = False) -> Dict:
    """One job in a fresh cgroup beside a fresh daemon (none for a fixed batch)."""
    daemon = MemdDaemon() if method != "fixed" else None
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if daemon:
        env["MEMD_ENDPOINT"] = daemon.endpoint
    cmd = [sys.executable, JOB, "--shape", "gpt", "--method", method, "--steps", str(steps),
           "--default-batch", str(4 * LONGEST if per_token else 4), "--lengths", lengths, "--seed", str(seed)]
    cmd += (["--batch", str(batch), "--steady-heap"] if batch else []) + (["--per-token"] if per_token else [])
    try:
        with MemoryCgroup(LIMIT) as cg, tempfile.TemporaryFile("w+") as out:
            started = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, env=env, preexec_fn=cg.join,
                                    start_new_session=True)
            try:
                code = proc.wait(1800)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            out.seek(0)
            events = [json.loads(line) for line in out if line.startswith("{")]
            return {"method": method, "seed": seed, "batch": batch or None, "per_token": per_token, "exit_code": code,
                    "killed": cg.oom_kills() > 0, "cgroup_peak_bytes": cg.peak_bytes(),
                    "seconds": round(time.monotonic() - started, 1),
                    "steps": [[e["batch"], e["length"], e["hwm"]] for e in events if e["e"] == "step"],
                    "last_try": next(([e["batch"], e["length"]] for e in reversed(events) if e["e"] == "try"), None)}
    finally:
        if daemon:
            daemon.stop()


def path(steps: List[List[int]]) -> str:
    """The batch sizes in turn, each with the lengths the job ran at it: '4 (64-192), 17 (64)'."""
    stays: List[List] = []
    for batch, length, _ in steps:
        if not stays or stays[-1][0] != batch:
            stays.append([batch, set()])
        stays[-1][1].add(length)
    return ", ".join("%d (%s)" % (b, "-".join(str(n) for n in sorted(ls)) if len(ls) < 3 else
                                 "%d-%d" % (min(ls), max(ls))) for b, ls in stays)


def budgets(steps: List[List[int]]) -> str:
    """The token budgets in turn: '1024, 2048, 4096'."""
    return ", ".join(str(b) for k, (b, _, _) in enumerate(steps) if k == 0 or steps[k - 1][0] != b)


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

"""The README's loop on this machine's host pool: `client.suggest_batch(default=32)` once a step
around a small torch model, no cgroup, for --minutes, against one real `memd serve`.

    sudo .venv/bin/python bench/hostloop.py [--minutes 10] [--out DIR]

Made safe for a shared machine: the job's oom_score_adj is 1000 (the kernel's OOM killer takes it
first) and a watchdog kills it when MemAvailable falls under 1 GiB (counted as a kill). Every
second it reads memd's view of the job (`status`: budget, predicted peak, plan) beside the host's
MemTotal and MemAvailable, and prints whether each budget stayed within MemTotal less the OS
reserve memd keeps (and its margin). The job's batches are what it ran; the kill is the
watchdog's or the kernel's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

from bench.exam import HOST_FLOOR, HostGuard, host_preexec, mem_available  # noqa: E402
from bench.realjobs import MemdDaemon  # noqa: E402

GiB = 2 ** 30
LOOP = '''
import sys, time, torch
from memd import client
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.AdamW(model.parameters())
deadline = time.monotonic() + float(sys.argv[1])
i = 0
while time.monotonic() < deadline:
    bs = client.suggest_batch(default=32)
    x, y = torch.randn(bs, 32), torch.randint(0, 10, (bs,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    print('{"e": "step", "i": %d, "batch": %d, "t": %.2f}' % (i, bs, time.monotonic()), flush=True)
    i += 1
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--out", default=None, help="write the run's reads here as JSON lines")
    args = ap.parse_args(argv)
    from memd.client import call
    from memd.config import PolicyConfig
    from memd.policy.budget import margin, os_reserve

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    cfg = PolicyConfig()
    bound = total - os_reserve(total, cfg) - margin(total, cfg)
    daemon = MemdDaemon()
    reads, batches = [], []
    try:
        env = dict(os.environ, MEMD_ENDPOINT=daemon.endpoint,
                   PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "client")]))
        proc = subprocess.Popen([sys.executable, "-c", LOOP, str(args.minutes * 60)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env, preexec_fn=host_preexec)
        guard = HostGuard(proc)
        guard.start()

        def watch():
            while proc.poll() is None:
                try:
                    sessions = call("status", endpoint=daemon.endpoint, timeout=1.0)["sessions"]
                except Exception:
                    sessions = []
                for s in sessions:
                    reads.append({"t": round(time.monotonic(), 1), "budget": s.get("budget_bytes"),
                                  "predicted": s.get("predicted_peak_bytes"), "batch": (s.get("plan") or {}).get(
                                      "batch_size"), "available": mem_available(),
                                  "reason": (s.get("plan") or {}).get("reason")})
                time.sleep(1.0)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for line in proc.stdout:
            if line.startswith('{"e": "step"'):
                batches.append(json.loads(line)["batch"])
        code = proc.wait()
        guard.done.set()
        watcher.join(2.0)
    finally:
        daemon.stop()
    budgets = [r["budget"] for r in reads if r["budget"] is not None]
    killed = guard.fired or code in (-9, 137)
    summary = {
        "minutes": args.minutes, "steps": len(batches), "killed": killed, "exit_code": code,
        "final_batch": batches[-1] if batches else None, "largest_batch": max(batches, default=None),
        "mem_total_bytes": total, "bound_bytes": bound, "largest_budget_bytes": max(budgets, default=None),
        "budgets_within_bound": all(b <= bound for b in budgets), "least_available_bytes": guard.least,
        "watchdog_floor_bytes": HOST_FLOOR,
    }
    if args.out:
        with open(args.out, "w") as f:
            for r in reads:
                f.write(json.dumps(r) + "\n")
    print(json.dumps(summary, indent=1))
    return 0 if not killed and summary["budgets_within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())

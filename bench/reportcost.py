"""What one `report` costs the daemon in CPU, by the number of sessions in one pool.

    python bench/reportcost.py [--sessions 1,16,64,256] [--rounds 20] [--repeats 5]

The daemon's handlers (memd.ops) called in process, no sockets: the policy's share of a report,
which grows with the sessions it shares a pool with (the wire's share is in bench/latency.py;
the whole path under load in bench/load.py). N local sessions on a synthetic 512 GB host, each
reporting once per round at the batch it was planned, its peak on its line (1 GB + 10 MB a
sample); a new sample of the machine every two rounds, as a daemon sampling 5 times a second
sees jobs that report 10 times a second. Two ways in the same run: as the daemon runs (a step
that went as planned is learned from at the next sample: memd.ops.session_ops.as_planned), and with every report
decided at once (the daemon before). Prints the median CPU microseconds per report of
``--repeats`` runs and the ratio.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

from memd import ops  # noqa: E402
from memd.ops import session_ops  # noqa: E402
from memd.config import Config  # noqa: E402
from memd.core import Core  # noqa: E402
from memd.sampling.snapshot import CPU, JobMemory, ProcessMemory, Snapshot, SystemMemory  # noqa: E402
from memd.sessions import Sessions  # noqa: E402
from memd.state import StateStore  # noqa: E402

GB = 10 ** 9


def cost(sessions: int, rounds: int, decide_all: bool) -> float:
    """CPU seconds per report, after three rounds of warm-up."""
    tmp = tempfile.mkdtemp(prefix="memd-reportcost-")
    for pid in range(1, sessions + 1):
        os.makedirs(os.path.join(tmp, "proc", str(pid)))
    now = [1000.0]
    core = Core(config=Config(), sessions=Sessions(sessions, 600.0, lambda: now[0], lambda s: True),
                store=StateStore(os.path.join(tmp, "state")), clock=lambda: now[0], host="here",
                proc_root=os.path.join(tmp, "proc"))
    core.snapshot = Snapshot(taken_at=0.0, monotonic=0.0, host="here", memory_model=CPU,
                             system=SystemMemory(512 * GB, 400 * GB, 112 * GB, 0, 0), pressure=None, cgroup=None)
    core.jobs = {pid: JobMemory(pid, (ProcessMemory(pid, 1, "python", GB, GB, GB),), None, (), 0.0)
                 for pid in range(1, sessions + 1)}
    tokens = [ops.hello(core, dict(job="job%d" % pid, pid=pid, host="here", default_batch=8))["token"]
              for pid in range(1, sessions + 1)]
    planned = {token: 8 for token in tokens}

    def one_round(k: int) -> None:
        for token in tokens:
            now[0] += 1e-4
            batch = planned[token]
            reply = ops.report(core, {"token": token, "batch_size": batch, "peak_bytes": GB + batch * 10 ** 7})
            planned[token] = reply["plan"]["batch_size"]
        if k % 2:
            core.snapshot = dataclasses.replace(core.snapshot, monotonic=now[0])

    with mock.patch.object(session_ops, "as_planned", lambda *a: False) if decide_all else contextlib.nullcontext():
        for k in range(3):
            one_round(k)
        started = time.process_time()
        for k in range(rounds):
            one_round(k)
        return (time.process_time() - started) / (sessions * rounds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print("%s, %d cores, Python %s; %d rounds, median of %d runs" % (
        platform.machine(), os.cpu_count(), platform.python_version(), args.rounds, args.repeats))
    print("| sessions | us/report | us/report, every report decided | ratio | CPU share at 10 reports/s each |")
    print("|---|---|---|---|---|")
    for n in (int(v) for v in args.sessions.split(",")):
        now = statistics.median(cost(n, args.rounds, False) for _ in range(args.repeats))
        before = statistics.median(cost(n, args.rounds, True) for _ in range(args.repeats))
        print("| %d | %.0f | %.0f | %.2f | %.2f core |" % (n, now * 1e6, before * 1e6, before / now, now * n * 10))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of one full sample, as the daemon takes it, with and without a job's process tree.

    python bench/sampling.py [--samples 2000] [--json]

Measures Sampler.sample() (meminfo, PSI, vmstat, the daemon's cgroup, GPUs, platform) median and
p99 in microseconds:
- host:          no GPU layer (what this machine has);
- host+2 GPUs:   through the real nvidia-ml-py against the fake driver (tests/fakenvml), when a C
                 compiler is here to build it: the cost of the Python side of NVML, not of a
                 real driver's ioctls;
- tree of 64:    with ``pid`` = a parent of 63 sleeping children (RSS/PSS/USS of each from
                 smaps_rollup, children through /proc/PID/task/*/children);
- job tree of 64: Sampler.job(pid), what the daemon reads for a live session every job_interval.
The first rounds are discarded; rounds alternate so drifting load on a shared machine falls on
all alike.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

from memd.sampling.sampler import Sampler  # noqa: E402


def spawn_tree(size: int):
    """A parent with size-1 children, each holding a little memory of its own."""
    pid = os.fork()
    if pid == 0:
        children = []
        for _ in range(size - 1):
            child = os.fork()
            if child == 0:
                buf = bytearray(1 << 20)  # 1 MiB touched: a real USS
                signal.pause()
                del buf
                os._exit(0)
            children.append(child)
        signal.signal(signal.SIGTERM, lambda *_: [os.kill(c, signal.SIGKILL) for c in children] and os._exit(0))
        while True:
            signal.pause()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # wait for every child to exist
        kids = sum(len(open("/proc/%d/task/%s/children" % (pid, t)).read().split())
                   for t in os.listdir("/proc/%d/task" % pid))
        if kids >= size - 1:
            return pid
        time.sleep(0.02)
    raise RuntimeError("tree did not start")


def kill_tree(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    os.waitpid(pid, 0)


def fake_gpus():
    """A Nvml over the fake driver with two GPUs, or None when it cannot be built here."""
    try:
        from tests.fakenvml import CONFIG_ENV, build, preload, write_config

        preload(build(tempfile.mkdtemp(), "full"))  # pynvml's CDLL("libnvidia-ml.so.1") finds it
    except Exception as exc:  # no compiler: report without this row
        print("(no fake NVML driver: %s)" % exc, file=sys.stderr)
        return None
    config = os.path.join(tempfile.mkdtemp(), "gpus.conf")
    write_config(config, "gpu GPU-11111111-aaaa total=80GiB used=10GiB reserved=512MiB util=40 name=NVIDIA H100 80GB HBM3\n"
                         "gpu GPU-22222222-bbbb total=80GiB used=1GiB name=NVIDIA H100 80GB HBM3\n")
    os.environ[CONFIG_ENV] = config
    from memd.sampling.nvml import Nvml

    nvml = Nvml()
    status = nvml.status()
    if not status.available:
        print("(fake NVML driver did not load: %s)" % status.reason, file=sys.stderr)
        return None
    return nvml


def timed(fn, n, out):
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)


def summary(times):
    ordered = sorted(times)
    return {"median_us": round(statistics.median(ordered) * 1e6, 1),
            "p99_us": round(ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1e6, 1), "n": len(ordered)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--tree", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    host = Sampler(gpus=None)
    nvml = fake_gpus()
    with_gpus = Sampler(gpus=nvml) if nvml is not None else None
    tree = spawn_tree(args.tree)
    try:
        cases = {"host": lambda: host.sample(), "tree of %d" % args.tree: lambda: host.sample(pid=tree),
                 "job tree of %d" % args.tree: lambda: host.job(tree)}
        if with_gpus is not None:
            cases["host+2 GPUs"] = lambda: with_gpus.sample()
        snap = host.sample(pid=tree)
        assert len(snap.processes) == args.tree, len(snap.processes)
        times = {name: [] for name in cases}
        rounds = 20
        for name, fn in cases.items():
            timed(fn, 20, [])  # warm-up
        for _ in range(rounds):
            for name, fn in cases.items():
                timed(fn, max(1, args.samples // rounds), times[name])
    finally:
        kill_tree(tree)
    result = {"machine": "%s, %s, %d cores, Python %s, kernel %s" % (
        platform.node(), platform.machine(), os.cpu_count(), platform.python_version(), platform.release()),
        "cases": {name: summary(t) for name, t in times.items()}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(result["machine"])
    print("%-18s %12s %12s %8s" % ("", "median us", "p99 us", "n"))
    for name, r in result["cases"].items():
        print("%-18s %12.1f %12.1f %8d" % (name, r["median_us"], r["p99_us"], r["n"]))


if __name__ == "__main__":
    main()

"""Round-trip latency of `plan` against the real daemon, beside a raw pyzmq baseline.

    python bench/latency.py [--calls 10000] [--json]

Measures, in one run on one machine (ratios matter more than absolutes on a shared box):
- raw:    a DEALER -> ROUTER round trip over ipc between two processes, msgpack both ways
          (an echo server doing nothing else): the floor any ZeroMQ daemon stands on;
- plan:   Session.plan() forced to ask the real `memd serve` every time (plan_fresh_seconds is
          set tiny), i.e. the whole client + wire + server + policy path;
- cached: Session.plan() while the plan is fresh (the training loop's hot path);
- report: Session.report() (fire-and-forget).
Reports median and p99 in microseconds, and plan/raw as a ratio (the budget is 1.5x).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

import zmq  # noqa: E402

from memd import client  # noqa: E402
from memd.client import protocol  # noqa: E402

ECHO = r"""
import sys, msgpack, zmq
ctx = zmq.Context(); sock = ctx.socket(zmq.ROUTER); sock.bind(sys.argv[1])
print("ready", flush=True)
while True:
    ident, data = sock.recv_multipart()
    req = msgpack.unpackb(data, raw=False)
    if req.get("op") == "stop":
        break
    sock.send_multipart([ident, msgpack.packb({"v": 1, "id": req["id"], "ok": True, "result": {"pong": True}})])
"""


def percentiles(samples):
    ordered = sorted(samples)
    return {"median_us": round(statistics.median(ordered) * 1e6, 1),
            "p99_us": round(ordered[int(len(ordered) * 0.99) - 1] * 1e6, 1), "n": len(ordered)}


def _start(cmd, env, endpoint):
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.call("ping", endpoint=endpoint, timeout=0.2)
            return proc
        except client.DaemonUnavailable:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.05)


def _raw_round_trips(sock, n, times):
    for i in range(n):
        start = time.perf_counter()
        sock.send(protocol.encode(protocol.request("ping", i)))
        reply = protocol.decode(sock.recv())
        times.append(time.perf_counter() - start)
        assert reply["id"] == i


def _plan_round_trips(session, n, times):
    for _ in range(n):
        start = time.perf_counter()
        plan = session.plan()
        times.append(time.perf_counter() - start)
        if plan.source != "daemon":
            raise RuntimeError("plan fell back: %s" % plan.reason)


def bench(tmp, calls, rounds=20):
    """Both servers up at once; raw and plan measured in alternating rounds so that drifting
    load on a shared machine falls on both alike."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "client")]),
               MEMD_POLICY_PLAN_FRESH_SECONDS="0.000001")  # every plan() asks the daemon
    echo_ep, memd_ep = "ipc://%s/echo.sock" % tmp, "ipc://%s/memd.sock" % tmp
    echo = _start([sys.executable, "-c", ECHO, echo_ep], env, echo_ep)
    daemon = _start([sys.executable, "-m", "memd", "serve", "--endpoint", memd_ep, "--metrics-address", "off",
                     "--state-dir", os.path.join(tmp, "state")], env, memd_ep)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(echo_ep)
    try:
        s = client.Session("bench", endpoint=memd_ep, timeout=1.0, default_batch=32)
        s.report(batch_size=32, peak_bytes=10 ** 9)
        _raw_round_trips(sock, 200, [])  # warm-up
        _plan_round_trips(s, 200, [])
        raw, plan = [], []
        per_round = max(1, calls // rounds)
        for _ in range(rounds):
            _raw_round_trips(sock, per_round, raw)
            _plan_round_trips(s, per_round, plan)
        # The hot path: a plan that is still fresh.
        s._plan_expires = time.monotonic() + 3600
        cached = _per_call(s.plan, calls)
        report = _per_call(lambda: s.report(batch_size=32, peak_bytes=10 ** 9), calls)
        s.close()
        return percentiles(raw), percentiles(plan), cached, report
    finally:
        sock.send(protocol.encode(protocol.request("stop", 0)))
        sock.close(linger=1000)
        ctx.term()
        daemon.terminate()
        daemon.wait(10)
        echo.wait(5)


def _per_call(fn, calls, batch=100):
    """Median and p99 per call, timing batches of calls (single calls are below the timer's resolution)."""
    times = []
    for _ in range(max(1, calls // batch)):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - start) / batch)
    return percentiles(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw, plan, cached, report = bench(tmp, args.calls)
    result = {
        "machine": "%s, %s, %d cores, Python %s" % (platform.node(), platform.machine(), os.cpu_count(),
                                                    platform.python_version()),
        "raw_pyzmq_round_trip": raw, "plan_round_trip": plan, "plan_cached": cached, "report": report,
        "plan_over_raw_median": round(plan["median_us"] / raw["median_us"], 2),
        "plan_over_raw_p99": round(plan["p99_us"] / raw["p99_us"], 2),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(result["machine"])
    print("%-28s %12s %12s %8s" % ("", "median us", "p99 us", "n"))
    for name in ("raw_pyzmq_round_trip", "plan_round_trip", "plan_cached", "report"):
        r = result[name]
        print("%-28s %12.1f %12.1f %8d" % (name, r["median_us"], r["p99_us"], r["n"]))
    print("plan / raw: %.2fx median, %.2fx p99 (budget 1.5x)" % (result["plan_over_raw_median"],
                                                                 result["plan_over_raw_p99"]))


if __name__ == "__main__":
    main()

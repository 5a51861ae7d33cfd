"""Where a stalled ping's time goes: bench/fuzz.py, watched from the kernel's side.

    python bench/stallwatch.py [--nice N] [--arm 0.05] [--json PATH] -- --frames 100000 --fake-gpus

Runs bench/fuzz.py with the arguments after ``--`` and pings each daemon it starts (its own
children only, never another memd on the machine) every 20 ms on a DEALER of its own. When a
ping is still unanswered after ``--arm`` seconds, each thread of the daemon and of this process
is read from /proc (state, and schedstat: CPU time and time spent runnable but waiting for a
CPU), and read again when the reply comes: a stall that is the daemon's own work shows as the
main thread's CPU time; one that is the machine's shows as run-queue wait (of the main thread,
the daemon's libzmq I/O thread, or this client's). ``--nice N`` sets every thread of the
fuzzer's children (the daemon and its probe) to nice N, a control: a stall that is CPU contention
shrinks, one inside the daemon (a lock, the GIL held by a long call, a collection) does not. Nice
orders threads within one session only where the kernel groups sessions (autogroup), so other
sessions keep their share. Linux only; reads nothing but /proc. The fuzzer's own summary is
written where its --json says; this script's summary (stalls over 100 ms, and what each was) is
written to --json or printed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "client"))
import zmq  # noqa: E402

from memd.client import protocol  # noqa: E402

Threads = Dict[str, Tuple[str, str, int, int]]  # tid -> (name, state, cpu ns, run-queue wait ns)
INTERVAL, REPORTED = 0.02, 0.100  # seconds between pings; stalls longer than this are listed


def children(parent: int) -> List[Tuple[int, List[bytes]]]:
    """(pid, argv) of the processes whose parent is ``parent``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                with open("/proc/%s/cmdline" % name, "rb") as f:
                    found.append((int(name), f.read().split(b"\0")))
        except (OSError, IndexError, ValueError):
            continue
    return found


def threads(pid: int) -> Threads:
    out: Threads = {}
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return out
    for tid in tids:
        base = "/proc/%d/task/%s/" % (pid, tid)
        try:
            with open(base + "stat") as f:
                stat = f.read()
            with open(base + "schedstat") as f:
                cpu, wait = (int(v) for v in f.read().split()[:2])
        except (OSError, ValueError):
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        main = " (main)" if int(tid) == pid else ""
        out[tid] = (name + main, stat[stat.rindex(")") + 2], cpu, wait)
    return out


def spent(before: Threads, after: Threads) -> List[Dict[str, object]]:
    """Each thread's CPU and run-queue wait between two readings (those that did either)."""
    rows = []
    for tid, (name, _, cpu, wait) in after.items():
        if tid in before:
            row = {"thread": name, "state_then": before[tid][1], "cpu_ms": round((cpu - before[tid][2]) / 1e6, 1),
                   "runq_wait_ms": round((wait - before[tid][3]) / 1e6, 1)}
            if row["cpu_ms"] or row["runq_wait_ms"]:
                rows.append(row)
    return rows


def renice(parent: int, nice: int, stop: threading.Event) -> None:
    done = set()
    while not stop.is_set():
        for pid, _ in children(parent):
            for tid in threads(pid):
                if (pid, tid) not in done:
                    try:
                        os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                        done.add((pid, tid))
                    except OSError:
                        pass
        stop.wait(0.3)


def watch(fuzz: subprocess.Popen, arm: float) -> Dict[str, object]:
    ctx = zmq.Context()
    sock: Optional[zmq.Socket] = None
    daemon, n, pings, stalls = None, 0, [], []
    while fuzz.poll() is None:
        found = [(pid, argv) for pid, argv in children(fuzz.pid) if b"serve" in argv and b"--endpoint" in argv]
        if not found:
            time.sleep(0.1)
            continue
        pid, argv = found[-1]
        if daemon != pid:  # a new daemon (the next transport): a new connection, its first ping not counted
            if sock is not None:
                sock.close(0)
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(argv[argv.index(b"--endpoint") + 1].decode())
            daemon, first = pid, n + 1
        assert sock is not None
        n += 1
        start = time.perf_counter()
        sock.send(protocol.encode(protocol.request("ping", n)))
        armed: Optional[Tuple[Threads, Threads, str]] = None
        answered = False
        while True:
            if sock.poll(int((arm if armed is None else 5.0) * 1000), zmq.POLLIN):
                if protocol.decode(sock.recv()).get("id") == n:
                    answered = True
                    break
                continue  # an earlier ping's late reply
            if armed is not None:
                break  # 5 s more: the daemon is stopping (the fuzzer's next stage)
            with open("/proc/loadavg") as f:
                armed = (threads(pid), threads(os.getpid()), " ".join(f.read().split()[:3]))
        took = time.perf_counter() - start
        if n != first and answered:
            pings.append(took)
            if armed is not None and took > REPORTED:
                daemon_spent, client_spent = spent(armed[0], threads(pid)), spent(armed[1], threads(os.getpid()))
                stalls.append({"ms": round(took * 1000, 1), "loadavg": armed[2], "daemon": daemon_spent,
                               "client": client_spent})
        time.sleep(INTERVAL)
    ctx.destroy(0)
    pings.sort()
    return {"pings": len(pings), "ping_ms_p50": round(pings[len(pings) // 2] * 1000, 2) if pings else None,
            "ping_ms_max": round(pings[-1] * 1000, 1) if pings else None, "stalls_over_100ms": stalls}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nice", type=int, help="nice value for the fuzzer's daemon and probe (a control)")
    parser.add_argument("--arm", type=float, default=0.05, help="seconds a ping waits before threads are read")
    parser.add_argument("--json", help="write this script's summary here")
    parser.add_argument("fuzz_args", nargs=argparse.REMAINDER, help="-- then bench/fuzz.py's arguments")
    args = parser.parse_args(argv)
    fuzz_args = args.fuzz_args[1:] if args.fuzz_args[:1] == ["--"] else args.fuzz_args
    fuzz = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz.py"),
                             *fuzz_args])
    stop = threading.Event()
    if args.nice is not None:
        threading.Thread(target=renice, args=(fuzz.pid, args.nice, stop), daemon=True).start()
    try:
        result = watch(fuzz, args.arm)
    finally:
        stop.set()
    result = {"fuzz": fuzz_args, "nice": args.nice, "fuzz_exit": fuzz.wait(), **result}
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

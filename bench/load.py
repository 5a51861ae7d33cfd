"""Load the real daemon: many clients at a fixed rate, the session cap reporting, and kill -9.

    python bench/load.py [--clients 64 --rate 200 --seconds 60 --report-share 0.5]
    python bench/load.py --mode sessions [--clients 256 --rate 10 --seconds 60]
    python bench/load.py --mode kill [--kills 50 --clients 2] [--flush-interval S --during-writes]
    ... [--json PATH] [--markdown PATH]

rate: N clients, each its own DEALER with a session of its own (hello first), send R requests a
second each for S seconds, open loop (on a fixed schedule, whether or not replies came): plans
and reports (a synthetic job's peaks at the batch it was last planned) in the given share.
Reports sent, answered, dropped (the client's queue full), lost (no reply within 5 s of the
end), errors by code, latency p50/p99/max (send to reply, as the client sees it), how far the
senders fell behind their schedule, and the daemon's CPU (utime + stime from /proc/PID/stat)
per request and as a share of one core, beside its idle share (its own sampling).

sessions: the same at the documented cap, 256 sessions reporting 10 times a second each (the
issue's target: within half a core here).

kill: clients train (memd.client.Session: plan, a step, report) throughout while the daemon is
killed with SIGKILL and started again ``--kills`` times, each after 1 to 3 s of training
(``--settle``). After each kill the state file is read (valid JSON of the layout memd writes,
or absent: else corrupt), and after each restart the temp files of writes cut short must be
gone. Counts corrupt state files and clients that crashed or that a call blocked past its
timeout, and compares what each job was told after a restart with what it had been told before
the kill (the batch it had learned). ``--during-writes`` kills the moment a state write is under
way (a temp file exists), with ``--flush-interval`` short enough that writes are frequent.
Exits 1 when a check fails; the summary says which.
"""
from __future__ import annotations

import argparse
import collections
import heapq
import json
import multiprocessing
import os
import random
import socket
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zmq  # noqa: E402
from memdproc import MemdProcess, commit, machine, percentiles, publish  # noqa: E402

from memd.client import protocol  # noqa: E402

GiB, MiB = 2 ** 30, 2 ** 20
DRAIN = 5.0  # seconds after the last send within which a reply still counts
SLACK = 0.010  # seconds past a Session's timeout that a call may take before it counts as blocked


# -- rate and sessions: open-loop clients on raw sockets ----------------------------------------


def drive(endpoint: str, first: int, count: int, rate: float, seconds: float, report_share: float, seed: int,
          conn) -> None:
    """Clients first..first+count-1 in this process: hello each, say "ready", wait for the start
    time, then send on schedule for ``seconds`` and collect replies until DRAIN after. Sends
    the tallies back through ``conn``."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    clients = [_Client(ctx, endpoint, "load-%d" % (first + i), rng) for i in range(count)]
    conn.send("ready")
    start = conn.recv()
    period, end = 1.0 / rate, start + seconds
    due = [(start + rng.random() * period, i) for i in range(count)]  # staggered, then every period
    heapq.heapify(due)
    poller = zmq.Poller()
    for client in clients:
        poller.register(client.sock, zmq.POLLIN)
    by_sock = {c.sock: c for c in clients}
    tally = {"sent": 0, "dropped": 0, "answered": 0, "errors": collections.Counter(), "latency": [], "behind": 0.0}
    while True:
        now = time.monotonic()
        while due and due[0][0] <= now:
            at, i = heapq.heappop(due)
            clients[i].send(rng.random() < report_share, tally)
            tally["behind"] = max(tally["behind"], now - at)
            if at + period < end:
                heapq.heappush(due, (at + period, i))
        if not due and (not any(c.waiting for c in clients) or now > end + DRAIN):
            break
        wait = (due[0][0] - now) if due else end + DRAIN - now
        for sock, _ in poller.poll(max(1, int(wait * 1000))):
            by_sock[sock].receive(tally)
    tally["lost"] = sum(len(c.waiting) for c in clients)
    for client in clients:
        client.sock.close(0)
    ctx.term()
    conn.send(tally)


class _Client:
    """One job's socket and session: plans, and reports of a synthetic step's peak (1 GiB and
    8 MiB a sample, a little noise) at the batch it was last planned."""

    def __init__(self, ctx: zmq.Context, endpoint: str, job: str, rng: random.Random):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.rng, self.ids, self.step = rng, 0, 0
        self.waiting: Dict[int, float] = {}  # request id: when it was sent
        self.sock.send(protocol.encode(protocol.request(
            "hello", 0, job=job, pid=os.getpid(), host=socket.gethostname(), default_batch=32, max_batch=4096,
            nonce="%032x" % rng.getrandbits(128))))
        if not self.sock.poll(30_000):
            raise RuntimeError("no reply to hello")
        result = protocol.decode(self.sock.recv())["result"]
        self.token, self.batch = result["token"], result["plan"]["batch_size"]

    def send(self, report: bool, tally: Dict[str, Any]) -> None:
        self.ids += 1
        if report:
            self.step += 1
            peak = GiB + self.batch * 8 * MiB + self.rng.randrange(16 * MiB)
            message = protocol.request("report", self.ids, token=self.token, batch_size=self.batch,
                                       peak_bytes=peak, step=self.step, step_seconds=0.1)
        else:
            message = protocol.request("plan", self.ids, token=self.token)
        try:
            self.sock.send(protocol.encode(message), zmq.NOBLOCK)
        except zmq.Again:  # its queue is full (SNDHWM): the daemon is that far behind
            tally["dropped"] += 1
            return
        self.waiting[self.ids] = time.monotonic()
        tally["sent"] += 1

    def receive(self, tally: Dict[str, Any]) -> None:
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            reply = protocol.decode(self.sock.recv())
            sent = self.waiting.pop(reply.get("id"), None)
            if sent is None:
                continue
            tally["latency"].append(time.monotonic() - sent)
            tally["answered"] += 1
            if reply.get("ok"):
                self.batch = reply["result"]["plan"]["batch_size"]
            else:
                tally["errors"][reply["error"]["code"]] += 1


def run_rate(args) -> Dict[str, Any]:
    """N clients over ``args.procs`` processes against one daemon with its defaults."""
    daemon = MemdProcess().start()
    spawn = multiprocessing.get_context("spawn")
    shares = [args.clients // args.procs + (1 if p < args.clients % args.procs else 0) for p in range(args.procs)]
    pipes, procs, first = [], [], 0
    try:
        for p, count in enumerate(shares):
            here, there = spawn.Pipe()
            proc = spawn.Process(target=drive, args=(daemon.endpoint, first, count, args.rate, args.seconds,
                                                     args.report_share, args.seed + p, there), daemon=True)
            proc.start()
            pipes.append(here)
            procs.append(proc)
            first += count
        for here in pipes:
            if here.recv() != "ready":
                raise RuntimeError("a load process failed to start")
        idle = daemon.cpu_seconds()
        time.sleep(args.idle)  # its own sampling costs the daemon this much with nobody asking
        start = time.monotonic() + 0.5
        cpu0, rss0 = daemon.cpu_seconds(), daemon.rss_bytes()
        idle = (cpu0 - idle) / args.idle
        for here in pipes:
            here.send(start)
        tallies = [here.recv() for here in pipes]
        wall, cpu = time.monotonic() - start, daemon.cpu_seconds() - cpu0
        rss = daemon.rss_bytes()
        for proc in procs:
            proc.join(5)
    finally:
        exit_code = daemon.stop()
    return rate_summary(args, tallies, wall, cpu, idle, [rss0, rss], exit_code)


def rate_summary(args, tallies: List[Dict], wall: float, cpu: float, idle: float, rss: List[int],
                 exit_code: Optional[int]) -> Dict[str, Any]:
    """The load processes' tallies together, and the daemon's CPU per answer (``cpu`` seconds
    over ``wall``, its own sampling costing ``idle`` of a core)."""
    sent, answered = sum(t["sent"] for t in tallies), sum(t["answered"] for t in tallies)
    dropped = sum(t["dropped"] for t in tallies)
    errors = sum((t["errors"] for t in tallies), collections.Counter())
    return {
        "mode": args.mode, "clients": args.clients, "rate_per_client": args.rate, "seconds": args.seconds,
        "report_share": args.report_share, "load_processes": args.procs,
        "offered": sent + dropped, "sent": sent, "dropped_queue_full": dropped, "answered": answered,
        "lost": sum(t["lost"] for t in tallies), "errors": dict(errors),
        "sent_per_second": round(sent / args.seconds), "answered_per_second": round(answered / wall),
        "senders_behind_max_ms": round(max(t["behind"] for t in tallies) * 1e3, 1),
        "latency_ms": percentiles([x for t in tallies for x in t["latency"]]),
        "daemon_cpu_seconds": round(cpu, 2), "daemon_cpu_share": round(cpu / wall, 3),
        "daemon_idle_cpu_share": round(idle, 3), "daemon_cpu_us_per_request": round(cpu / max(1, answered) * 1e6, 1),
        "daemon_cpu_us_per_request_less_idle": round(max(0.0, cpu - idle * wall) / max(1, answered) * 1e6, 1),
        "daemon_rss_bytes": rss, "daemon_exit_code": exit_code,
        "checks": {"0 lost": sent > 0 and sent == answered and not dropped, "no error replies": not errors,
                   "daemon exited 0": exit_code == 0},
    }


# -- kill: a training loop while the daemon is killed and restarted -------------------------------


def train(endpoint: str, job: str, timeout: float, seed: int, conn) -> None:
    """A training loop through the public client: plan, a 10 ms step, report its peak (256 MiB
    and 1 MiB a sample: at max_batch 4096 two such jobs fit this machine's free memory, so what
    a job is told depends on what the daemon remembers, not on the other job). Each step is
    (time, batch, source, the longer call's seconds, the plan's reason when it came from a
    reply since the last step); sent through ``conn`` when told to stop. An exception ends it
    with exit code 1 (a crash)."""
    from memd.client import Session

    rng = random.Random(seed)
    steps: List[tuple] = []
    last = None
    with Session(job, endpoint=endpoint, timeout=timeout, default_batch=16, max_batch=4096) as session:
        while not conn.poll(0):
            start = time.perf_counter()
            plan = session.plan()
            took = time.perf_counter() - start
            time.sleep(0.01)
            start = time.perf_counter()
            session.report(plan.batch_size, peak_bytes=GiB // 4 + plan.batch_size * MiB + rng.randrange(4 * MiB))
            took = max(took, time.perf_counter() - start)
            # A plan the Session took from a reply since the last step (not one served from its cache)
            steps.append((time.time(), plan.batch_size, plan.source, took, plan.reason if plan is not last else None))
            last = plan
    conn.send(steps)


def state_file(state_dir: str) -> str:
    """"ok", "absent" or "corrupt: why": the state file as a restarted daemon will find it."""
    try:
        with open(os.path.join(state_dir, "curves.json")) as f:
            data = json.load(f)
    except FileNotFoundError:
        return "absent"
    except (OSError, ValueError) as exc:
        return "corrupt: %s" % exc
    if not (isinstance(data, dict) and data.get("version") == 1 and isinstance(data.get("jobs"), dict)):
        return "corrupt: unexpected layout"
    return "ok"


def temp_files(state_dir: str) -> List[str]:
    try:
        return [n for n in os.listdir(state_dir) if n.startswith(".curves.")]
    except FileNotFoundError:
        return []


def kill_once(daemon: MemdProcess, during_writes: bool) -> bool:
    """SIGKILL; with ``during_writes``, the moment a state write's temp file is seen (within 2 s).
    Returns whether one was there."""
    seen = False
    if during_writes:
        deadline = time.monotonic() + 2.0
        while not seen and time.monotonic() < deadline:
            seen = bool(temp_files(daemon.state_dir))
    daemon.kill()
    return seen or bool(temp_files(daemon.state_dir))


def run_kills(args) -> Dict[str, Any]:
    env = {"MEMD_FLUSH_INTERVAL": str(args.flush_interval)} if args.flush_interval else {}
    daemon = MemdProcess(env=env).start()
    spawn = multiprocessing.get_context("spawn")
    rng = random.Random(args.seed)
    trainers = []
    for i in range(args.clients):
        here, there = spawn.Pipe()
        proc = spawn.Process(target=train, args=(daemon.endpoint, "train-%d" % i, args.timeout, args.seed + i, there),
                             daemon=True)
        proc.start()
        trainers.append((proc, here))
    kills: List[Dict[str, Any]] = []
    try:
        time.sleep(args.settle)  # the jobs start and learn
        for _ in range(args.kills):
            time.sleep(rng.uniform(args.settle / 3, args.settle))
            killed_at = time.time()
            during = kill_once(daemon, args.during_writes)
            found = state_file(daemon.state_dir)
            daemon.start()
            kills.append({"at": killed_at, "back_at": time.time(), "during_write": during, "state": found,
                          "temps_after_restart": len(temp_files(daemon.state_dir)),
                          "moved_aside": os.path.exists(os.path.join(daemon.state_dir, "curves.json.corrupt"))})
        time.sleep(args.settle)  # what the jobs are told after the last restart
    finally:
        for _, here in trainers:
            here.send("stop")
        steps = [here.recv() if here.poll(30) else [] for _, here in trainers]
        for proc, _ in trainers:
            proc.join(10)
        exit_code = daemon.stop()
    return kill_summary(args, kills, steps, [p.exitcode for p, _ in trainers], exit_code)


def kill_summary(args, kills: List[Dict], steps: List[List[tuple]], exits: List[Optional[int]],
                 exit_code: Optional[int]) -> Dict[str, Any]:
    """Per restart and job: the last batch the daemon told it before the kill, the first it was
    told after the restart (from a reply, not the Session's cache), and how soon it was back."""
    told, recovered = [], []
    for job_steps in steps:
        daemon_steps = [(t, batch, new) for t, batch, source, _, new in job_steps if source == "daemon"]
        for kill in kills:
            before = [b for t, b, _ in daemon_steps if t < kill["at"]]
            after = [(t, b, new) for t, b, new in daemon_steps if t > kill["back_at"] and new]
            if before and after:
                told.append((before[-1], after[0][1], after[0][2]))
                back = next((t for t, b, _ in after if b >= 0.95 * before[-1]), None)
                recovered.append(back - kill["back_at"] if back is not None else None)
    calls = [step[3] for job_steps in steps for step in job_steps]
    corrupt = [k["state"] for k in kills if k["state"].startswith("corrupt") or k["moved_aside"]]
    blocked = sum(1 for took in calls if took > args.timeout + SLACK)
    less = [(b, a, why) for b, a, why in told if a < 0.95 * b]  # within 5 %: the pool's free memory moved
    return {
        "mode": "kill", "kills": len(kills), "clients": args.clients, "client_timeout_s": args.timeout,
        "flush_interval": args.flush_interval or "daemon default", "during_writes": args.during_writes,
        "kills_during_a_write": sum(k["during_write"] for k in kills),
        "state_after_kill": dict(collections.Counter(k["state"] for k in kills)), "corrupt_state_files": len(corrupt),
        "temp_files_left_after_restart": sum(k["temps_after_restart"] for k in kills),
        "client_exit_codes": exits, "clients_crashed": sum(1 for e in exits if e != 0),
        "steps": len(calls), "calls_past_timeout": blocked, "longest_call_ms": round(max(calls, default=0) * 1e3, 1),
        "fallback_steps": sum(1 for job_steps in steps for s in job_steps if s[2] != "daemon"),
        "restarts_compared": len(told), "told_any_less": sum(1 for b, a, _ in told if a < b),
        "told_under_95pct": len(less),
        "median_before_after": [statistics.median(t[i] for t in told) for i in (0, 1)] if told else None,
        "examples_told_less": [[b, a, why[:160]] for b, a, why in less[:6]],
        "seconds_back_to_95pct_median": round(statistics.median(r for r in recovered if r is not None), 2)
        if any(r is not None for r in recovered) else None,
        "never_back_to_95pct": sum(1 for r in recovered if r is None), "daemon_exit_code": exit_code,
        "checks": {"0 corrupt state files": not corrupt, "no client crashed": all(e == 0 for e in exits),
                   "no call blocked past its timeout": blocked == 0,
                   "no restart told a job under 95 % of what it had learned": not less},
    }


# -- output ------------------------------------------------------------------------------------


def markdown(s: Dict[str, Any]) -> str:
    lines = ["# memd load, %s mode: %s" % (s["mode"], "passed" if s["passed"] else "FAILED"), "",
             "`%s` at %s on %s." % (s["command"], s["commit"], s["machine"]), "", "| check | |", "|---|---|"]
    lines += ["| %s | %s |" % (k, "pass" if v else "**fail**") for k, v in s["checks"].items()]
    lines += ["", "| figure | value |", "|---|---|"]
    shown = {k: v for k, v in s.items() if k not in ("checks", "command", "commit", "machine", "passed")}
    lines += ["| %s | %s |" % kv for kv in shown.items()]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("rate", "sessions", "kill"), default="rate")
    parser.add_argument("--clients", type=int, help="default 64 (rate), 256 (sessions), 2 (kill)")
    parser.add_argument("--rate", type=float, help="requests a second per client: default 200 (rate), 10 (sessions)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--report-share", type=float, help="reports among requests: default 0.5 (rate), 1 (sessions)")
    parser.add_argument("--procs", type=int, default=1, help="load processes the clients are spread over")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds the idle daemon's CPU is read first")
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds of training before the first kill and after the last; kills come "
                             "settle/3 to settle seconds apart")
    parser.add_argument("--timeout", type=float, default=0.05, help="the training Sessions' timeout (kill)")
    parser.add_argument("--flush-interval", type=float, help="the daemon's flush_interval (kill; default its own)")
    parser.add_argument("--during-writes", action="store_true", help="kill while a state write is under way")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    sessions = args.mode == "sessions"
    args.clients = args.clients or (256 if sessions else 2 if args.mode == "kill" else 64)
    args.rate = args.rate or (10.0 if sessions else 200.0)
    args.report_share = args.report_share if args.report_share is not None else 1.0 if sessions else 0.5
    result = run_kills(args) if args.mode == "kill" else run_rate(args)
    result = dict({"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": machine(),
                   "commit": commit()}, **result, passed=all(result["checks"].values()))
    return publish(result, markdown(result), args.json, args.markdown)


if __name__ == "__main__":
    sys.exit(main())

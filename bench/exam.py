"""An exam of jobs nobody tuned memd for: generated from a seed, run in real memory cgroups.

    sudo .venv/bin/python bench/exam.py [--seed N] [--jobs 30] [--short] [--out DIR]

Each job is a real process (bench/examjob.py) whose steps touch real memory: in the private
heap, in anonymous or /dev/shm shared memory, in torch tensors, beside page cache it reads each
step; fixed-heavy or sample-heavy, some quadratic in the batch (a contrastive loss's b x b
logits), some with a spike on one step in twenty or a slow leak, steps of 20 ms to 3 s, some
importing torch first. Its default is drawn far above, far below or near what fits. Scenarios:
alone; restarted after a run its default killed (the same job name, the same daemon); beside a
neighbour in its group that grows and shrinks; two or three advised copies sharing one group,
started apart. Most pools are cgroups of 0.5-4 GiB; a few jobs (not with --short) run in the
host's pool, made safe for a shared machine: the job's oom_score_adj is 1000 (the kernel's
OOM killer takes it first) and a watchdog kills it when MemAvailable falls under 1 GiB (counted
as a kill).

Feasible is found by probing the same job (same imports, same memory per step) at fixed
batches, each a fresh process in a fresh cgroup of the same size: the largest batch that runs
its steps unkilled (beside the neighbour held at its most, or with the copies stepping
together). On the host pool a kill is not a probe this machine can afford: there the largest
batch whose steps leave MemAvailable at or above the OS reserve memd keeps (PolicyConfig's
os_reserve) is feasible, read every 10 ms.

Methods: suggest (client.suggest_batch alone), session (Session with report(peak_bytes=None))
and loader (MemdLoader, where torch is installed), against one real `memd serve` started here
with its embedded defaults. Per job and summed: kills (a run whose default does not fit may be
killed once: its restart is judged), the final batch over feasible, and the steps and seconds
after which the batch stayed at 95 % of feasible or more. Everything in the table is measured:
batches the jobs ran, kills the kernel counted; nothing is taken from memd's own view.

Writes DIR/results.json and DIR/table.md (default: a temporary directory, printed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

from bench.memcg import MemoryCgroup, available  # noqa: E402
from bench.realjobs import MemdDaemon, held_from  # noqa: E402

MiB, GiB = 2 ** 20, 2 ** 30
JOB = os.path.join(ROOT, "bench", "examjob.py")
REACHED = 0.95
KINDS = ("private", "heap", "shared", "shm", "torch", "cache")
HOST_FLOOR = 1 * GiB  # the watchdog kills a host-pool job when MemAvailable falls below this


def torch_installed() -> bool:
    try:
        import importlib.util
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


@dataclass
class ExamJob:
    name: str
    limit_bytes: Optional[int]  # the group's limit; None: the host's pool
    spec: dict  # bench/examjob.py's --spec
    method: str
    default: int
    scenario: str  # alone, restart, neighbour, shared
    copies: int = 1
    apart_seconds: float = 0.0  # between the starts of shared copies
    neighbour: Optional[str] = None  # examjob --neighbour schedule
    neighbour_most_mib: float = 0.0
    seconds: float = 30.0  # each run of the job stops after this long (or its steps)
    steps: int = 400
    aimed: int = 0  # the batch the generator aimed the pool at (feasible is probed, not this)

    def words(self) -> str:
        s = self.spec
        shape = "%s, fixed %d MiB, %.0f KiB/sample" % (s.get("kind"), s.get("fixed_mib", 0), s.get("sample_kib", 0))
        extras = [w for w, on in (("quadratic", s.get("quad_bytes")), ("spike 1/%s" % s.get("spike_every"),
                                  s.get("spike_every")), ("leak", s.get("leak_kib")), ("torch", s.get("torch")),
                                  ("cache %d MiB" % s.get("cache_mib", 0), s.get("cache_mib"))) if on]
        pool = "host" if self.limit_bytes is None else "%.2f GiB" % (self.limit_bytes / GiB)
        return "%s; %s%s; step %d ms; %s; default %d" % (pool, shape, "".join(", " + e for e in extras),
                                                         s.get("step_ms", 0), self.scenario, self.default)


def generate(seed: int, jobs: int, short: bool, torch_ok: bool) -> List[ExamJob]:
    """``jobs`` jobs drawn from ``seed``: the same seed gives the same jobs."""
    rng = random.Random(seed)
    out = []
    for i in range(jobs):
        scenario = rng.choices(("alone", "restart", "neighbour", "shared"), (55, 15, 15, 15))[0]
        host = not short and scenario == "alone" and rng.random() < 0.12
        limit = None if host else (rng.choice((8, 12, 16)) if short else rng.randint(8, 64)) * 64 * MiB
        kinds = [k for k in KINDS if torch_ok or k != "torch"]
        kind = rng.choice(kinds)
        method = rng.choice(("suggest", "session", "loader" if torch_ok and not short else "session"))
        imports = kind == "torch" or method == "loader" or (torch_ok and not short and rng.random() < 0.3)
        step_ms = int(math.exp(rng.uniform(math.log(20), math.log(300 if short else 3000))))
        pool = limit if limit is not None else 16 * GiB  # a host job: about 16 GiB of steps and fixed memory
        copies = rng.choice((2, 3)) if scenario == "shared" else 1
        room = pool - copies * (260 if imports else 40) * MiB  # each copy's interpreter (and torch), the kernel's
        neighbour_most = 0.0
        neighbour, neighbour_end = None, 0.0
        if scenario == "neighbour":
            # Grows while the job starts (another job loading, a preprocessing pass), holds, and
            # gives back before the run ends; how fast a neighbour may grow for memd to follow it
            # once a job runs at its edge is measured apart (docs/results.md, "A neighbour that grows").
            low, most = rng.uniform(0.05, 0.15) * pool / MiB, rng.uniform(0.2, 0.35) * pool / MiB
            start, up, down = rng.uniform(2, 6), rng.uniform(10, 25), rng.uniform(10, 25)
            top = start + up
            neighbour = "0:%d,%.1f:%d,%.1f:%d,%.1f:%d,%.1f:%d" % (low, start, low, top, most, top + 6, most,
                                                                    top + 6 + down, low)
            neighbour_end = top + 6 + down
            neighbour_most = most
            room -= int(most * MiB)
        share = room // copies
        fixed_share = rng.uniform(0.35, 0.6) if rng.random() < 0.4 else rng.uniform(0.03, 0.2)
        if host:  # a few GiB of steps beside the fixed: each step touches all of its memory
            fixed_share = rng.uniform(0.7, 0.8)
        fixed = int(share * fixed_share)
        aimed = int(math.exp(rng.uniform(math.log(6), math.log(80 if short else 1500))))
        if host:
            aimed = rng.randint(40, 200)
        step = share - fixed
        quad = rng.random() < 0.15
        quad_bytes = int(step * rng.uniform(0.3, 0.7) / aimed ** 2) if quad and aimed >= 4 else 0
        per_sample = max(4096, (step - quad_bytes * aimed * aimed) // aimed)
        spec = {"kind": kind, "fixed_mib": fixed // MiB, "sample_kib": round(per_sample / 1024, 1),
                "step_ms": step_ms}
        if quad_bytes:
            spec["quad_bytes"] = quad_bytes
        if imports:
            spec["torch"] = True
        if rng.random() < 0.15:
            spec["spike_every"], spec["spike"] = 20, round(rng.uniform(1.1, 1.4), 2)
        seconds = 12.0 if short else min(150.0, max(40.0, 45 * step_ms / 1000.0))
        if neighbour is not None:
            seconds = max(seconds, neighbour_end + 25)  # the end is judged beside the neighbour back low
        if rng.random() < 0.1 and not short:
            spec["leak_kib"] = max(4, int(0.05 * share / max(1, seconds * 1000 / max(step_ms, 50)) / 1024))
        if kind == "cache":
            spec["cache_mib"] = max(8, int(share * rng.uniform(0.1, 0.4) / MiB))
        if method == "loader":
            spec["workers"] = rng.choice((0, 1, 2))
        draw = rng.random()
        if scenario == "restart":
            default = int(aimed * rng.uniform(3, 6))
        elif draw < 0.3:
            default = max(1, int(aimed * rng.uniform(2.5, 5)) if scenario == "alone" else aimed // 2)
        elif draw < 0.6:
            default = max(1, int(aimed / rng.uniform(10, 60)))
        else:
            default = max(1, int(aimed * rng.uniform(0.2, 0.6)))
        if host:
            # Below what fits: a default that does not fit is killed by the watchdog here, not by
            # the kernel's OOM killer, whose count memd reads to learn a kill.
            default = max(1, int(aimed * rng.uniform(0.05, 0.5)))
        if copies > 1 and default > aimed // copies:
            default = max(1, aimed // (2 * copies))  # started apart: a copy's default that kills the first is
            # the restart scenario's, not this one's
        out.append(ExamJob(name="exam-%d-%d" % (seed, i), limit_bytes=limit, spec=spec, method=method,
                           default=default, scenario=scenario, copies=copies,
                           apart_seconds=rng.uniform(5, 15) if copies > 1 else 0.0, neighbour=neighbour,
                           neighbour_most_mib=neighbour_most, seconds=seconds, aimed=aimed))
    return out


# -- running one process -----------------------------------------------------------------------

@dataclass
class Run:
    batches: List[int] = field(default_factory=list)
    seconds: List[float] = field(default_factory=list)
    last_try: Optional[int] = None
    killed: bool = False
    exit_code: Optional[int] = None
    min_available: Optional[int] = None  # host pool: the least MemAvailable seen while it ran
    loader: Optional[Tuple[int, int]] = None  # a loader job's (workers, prefetch) at its last step

    def final(self) -> Optional[int]:
        return None if self.killed or not self.batches else self.batches[-1]


class HostGuard(threading.Thread):
    """Reads MemAvailable every 10 ms while a host-pool job runs: keeps the least, and kills the
    job's process group below HOST_FLOOR (the machine is shared)."""

    def __init__(self, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.proc, self.least, self.fired = proc, None, False
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set() and self.proc.poll() is None:
            free = mem_available()
            self.least = free if self.least is None else min(self.least, free)
            if free < HOST_FLOOR:
                self.fired = True
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return
            time.sleep(0.01)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def host_preexec() -> None:
    os.setpgrp()
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # the kernel's OOM killer takes this job first


def start(job: ExamJob, cg: Optional[MemoryCgroup], method: str, batch: Optional[int], seconds: float,
          steps: int, endpoint: Optional[str], name: Optional[str] = None, spec: Optional[dict] = None,
          workdir: str = "/tmp", loader: Optional[Tuple[int, int]] = None) -> subprocess.Popen:
    """The job's process (its events on stdout). ``loader``: a loader probe's (workers, prefetch)."""
    cmd = [sys.executable, JOB, "--spec", json.dumps(spec or job.spec), "--method", method,
           "--default-batch", str(job.default), "--job", name or job.name, "--steps", str(steps),
           "--seconds", str(seconds), "--workdir", workdir]
    if batch is not None:
        cmd += ["--batch", str(batch)]
    if loader is not None:
        cmd += ["--workers", str(loader[0]), "--prefetch", str(loader[1])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "client")]))
    if endpoint:
        env["MEMD_ENDPOINT"] = endpoint
    err = tempfile.TemporaryFile(mode="w+", dir=workdir)  # its traceback, if it fails (Run.failed)
    proc = subprocess.Popen(cmd, preexec_fn=cg.join if cg is not None else host_preexec, stdout=subprocess.PIPE,
                            stderr=err, text=True, env=env)
    proc.err = err  # type: ignore[attr-defined]
    return proc


def failure(proc: subprocess.Popen) -> str:
    """The last lines a job that failed (not killed) wrote to its stderr."""
    err = proc.err  # type: ignore[attr-defined]
    err.seek(0)
    return "".join(err.readlines()[-6:])


def follow(proc: subprocess.Popen, run: Run, t0: float, deadline: float) -> None:
    """Read a job's events until it ends (killed past ``deadline``)."""
    timer = threading.Timer(max(1.0, deadline - time.monotonic()), lambda: proc.poll() is None and proc.kill())
    timer.start()
    try:
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("e") == "try":
                run.last_try = event["batch"]
            elif event.get("e") == "step":
                run.batches.append(event["batch"])
                run.seconds.append(round(time.monotonic() - t0, 2))
                if "workers" in event:
                    run.loader = (event["workers"] or 0, event.get("prefetch") or 2)
        run.exit_code = proc.wait()
    finally:
        timer.cancel()


def neighbour_proc(job: ExamJob, cg: MemoryCgroup, probe: bool) -> subprocess.Popen:
    """The job's neighbour in its group: its schedule, or for a probe what it holds at its end
    (the run's final batch is judged beside that; what it holds at its most, the run survives)."""
    assert job.neighbour is not None
    schedule = "0:%s" % job.neighbour.rsplit(":", 1)[1] if probe else job.neighbour
    return subprocess.Popen([sys.executable, JOB, "--neighbour", schedule], preexec_fn=cg.join,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def sweep_shm() -> None:
    """Remove what killed jobs left in /dev/shm: PyTorch's shared-memory files (torch_<pid>_...)
    whose process is gone. A killed DataLoader worker's stay, and on this shared machine they are
    RAM (examjob's own are unlinked as they are made)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        parts = name.split("_")
        if len(parts) >= 2 and parts[0] == "torch" and parts[1].isdigit() and not os.path.exists("/proc/" + parts[1]):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


def stop(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


# -- feasible -----------------------------------------------------------------------------------

def probe(job: ExamJob, batch: int, steps: int, workdir: str, loader: Optional[Tuple[int, int]] = None) -> bool:
    """Whether ``batch`` runs ``steps`` steps of the job unkilled (with its copies, beside its
    neighbour at its most; a loader job beside the workers and prefetch memd's plan ended with,
    ``loader``). Sleeps are shortened (memory is what is probed), not below what lets copies'
    peaks meet."""
    spec = dict(job.spec)
    spec["step_ms"] = min(spec.get("step_ms", 0), 300) if job.copies > 1 else 0
    if job.limit_bytes is None:
        return probe_host(job, batch, steps, spec, workdir)
    with MemoryCgroup(job.limit_bytes) as cg:
        near = neighbour_proc(job, cg, probe=True) if job.neighbour else None
        if near is not None:
            time.sleep(1.0)  # it holds its memory before the job starts
        method = "loader" if job.method == "loader" else "fixed"  # a loader's probe runs the loader
        procs = [start(job, cg, method, batch, 600, steps, None, spec=spec, workdir=workdir,
                       loader=loader if method == "loader" else None) for _ in range(job.copies)]
        runs = [Run() for _ in procs]
        threads = [threading.Thread(target=follow, args=(p, r, time.monotonic(), time.monotonic() + 300))
                   for p, r in zip(procs, runs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop(near)
        sweep_shm()
        killed = cg.oom_kills() > 0
        for proc, run in zip(procs, runs):
            if run.exit_code not in (0, -9, 137) and not killed:
                raise RuntimeError("a probe of %s at %d failed:\n%s" % (job.name, batch, failure(proc)))
        return not killed and all(len(r.batches) == steps for r in runs)


def probe_host(job: ExamJob, batch: int, steps: int, spec: dict, workdir: str) -> bool:
    from memd.config import PolicyConfig
    from memd.policy.budget import os_reserve
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    spec = dict(spec, step_ms=150)  # held long enough for 10 ms reads to see each step's peak
    proc = start(job, None, "fixed", batch, 600, steps, None, spec=spec, workdir=workdir)
    guard = HostGuard(proc)
    guard.start()
    run = Run()
    follow(proc, run, time.monotonic(), time.monotonic() + 300)
    guard.done.set()
    guard.join()
    return (not guard.fired and len(run.batches) == steps and guard.least is not None
            and guard.least >= os_reserve(total, PolicyConfig()))


def feasible(job: ExamJob, steps: int, workdir: str, log, loader: Optional[Tuple[int, int]] = None,
             near: Optional[int] = None) -> Tuple[int, List[Tuple[int, bool]]]:
    """The largest batch that runs ``steps`` steps, by probes: out from ``near`` (where memd's run
    ended; else the batch the generator aimed at), then bisection to within 1 %."""
    probes: List[Tuple[int, bool]] = []

    def ok(b: int) -> bool:
        fits = probe(job, b, steps, workdir, loader)
        probes.append((b, fits))
        log("    probe %d: %s" % (b, "ran" if fits else "killed"))
        return fits

    b = max(1, near or job.aimed)
    if ok(b):
        lo, hi = b, None
        step = max(1, int(b * (0.03 if near else 0.08)))
        while hi is None:  # galloping: a run that ended far below what fits costs log2 probes, not one each
            up = lo + step
            if ok(up):
                lo, step = up, step * 2
            else:
                hi = up
    else:
        hi, lo = b, None
        while lo is None:
            down = hi // 2
            if down == 0:
                return 0, probes
            if ok(down):
                lo = down
            else:
                hi = down
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


# -- the method's runs -------------------------------------------------------------------------

def run_job(job: ExamJob, daemon: MemdDaemon, workdir: str, log) -> List[Dict]:
    """The job under memd: one run, or its copies, or a first run and its restart."""
    if job.limit_bytes is None:
        proc = start(job, None, job.method, None, job.seconds, job.steps, daemon.endpoint, workdir=workdir)
        guard = HostGuard(proc)
        guard.start()
        run = Run()
        follow(proc, run, time.monotonic(), time.monotonic() + job.seconds + 120)
        guard.done.set()
        guard.join()
        run.killed = guard.fired or run.exit_code in (-9, 137)
        run.min_available = guard.least
        return [dict(asdict(run), copy=0)]
    results = []
    lives = 2  # a first run its default killed is restarted, as its user would: the restart is judged
    for life in range(lives):
        with MemoryCgroup(job.limit_bytes) as cg:
            near = neighbour_proc(job, cg, probe=False) if job.neighbour else None
            procs, runs, threads = [], [], []
            t0 = time.monotonic()
            for copy in range(job.copies):
                if copy:
                    time.sleep(job.apart_seconds)
                name = job.name if job.copies == 1 else "%s-%s" % (job.name, "abc"[copy])
                proc = start(job, cg, job.method, None, job.seconds + job.apart_seconds * (job.copies - 1 - copy),
                             job.steps, daemon.endpoint, name=name, workdir=workdir)
                run = Run()
                thread = threading.Thread(target=follow, args=(proc, run, t0, time.monotonic() + job.seconds + 120))
                thread.start()
                procs.append(proc)
                runs.append(run)
                threads.append(thread)
            for thread in threads:
                thread.join()
            stop(near)
            sweep_shm()
            kills = cg.oom_kills()
        for copy, run in enumerate(runs):
            run.killed = run.exit_code in (-9, 137) or (kills > 0 and run.exit_code != 0)
            if run.exit_code != 0 and not run.killed:
                log("  copy %d failed:\n%s" % (copy, failure(procs[copy])))
            results.append(dict(asdict(run), copy=copy, life=life))
        log("  %s: %s" % ("restart" if life else "run", ", ".join(
            "killed at %s" % r.last_try if r.killed else "ended at %s" % r.final() for r in runs)))
        if not any(r.killed for r in runs):
            break
    return results


def judge(job: ExamJob, best: int, runs: List[Dict], default_fits: Optional[bool] = None) -> Dict:
    """What the exam counts of one job: kills (a first run whose default does not fit may be
    killed: it is restarted, and the restart is judged), each judged run's final batch over
    feasible, and when it reached 95 %."""
    restarted = any(r.get("life") == 1 for r in runs)
    judged = [r for r in runs if not (restarted and r.get("life") == 0)]
    excused = [r for r in runs if restarted and r.get("life") == 0]

    def unfit(r: Dict) -> bool:
        # Its default did not fit: above the batch probed to fit, or not beside the loader it
        # asked for (its probes ran beside the fewer workers memd's plan ended with), or killed
        # before its first step there ended, before any report could tell memd anything.
        return job.default > best or default_fits is False or not r["batches"]

    kills = sum(1 for r in judged if r["killed"])
    kills += sum(1 for r in excused if r["killed"] and not unfit(r))
    shares, reached_steps, reached_seconds = [], [], []
    for r in judged:
        final = None if r["killed"] or not r["batches"] else r["batches"][-1]
        shares.append(0.0 if final is None or not best else final / best)
        at = held_from(r["batches"], REACHED * best) if best and not r["killed"] else None
        reached_steps.append(at)
        reached_seconds.append(r["seconds"][at] if at is not None and at < len(r["seconds"]) else None)
    return {"kills": kills, "shares": shares, "reached_steps": reached_steps, "reached_seconds": reached_seconds,
            "excused_kills": sum(1 for r in excused if r["killed"] and unfit(r))}


# -- the report ----------------------------------------------------------------------------------

def table(seed: int, results: List[Dict]) -> str:
    lines = ["Seed %d." % seed, "",
             "| job | pool and shape | method | feasible | final batch | of feasible | kills | 95 % from step (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        finals = []
        for r in res["runs"]:
            if job_judged(res, r):
                finals.append("killed at %s" % r["last_try"] if r["killed"] else str(r["batches"][-1])
                              if r["batches"] else "-")
        shares = ", ".join("%.1f %%" % (100 * s) for s in res["judged"]["shares"])
        reached = ", ".join("-" if s is None else "%d (%.0f)" % (s, t or 0)
                            for s, t in zip(res["judged"]["reached_steps"], res["judged"]["reached_seconds"]))
        kills = str(res["judged"]["kills"]) + (" (+%d excused)" % res["judged"]["excused_kills"]
                                               if res["judged"]["excused_kills"] else "")
        lines.append("| %s | %s | %s | %d | %s | %s | %s | %s |" % (
            res["job"]["name"], res["words"], res["job"]["method"], res["feasible"], ", ".join(finals), shares,
            kills, reached))
    s = summary(results)
    lines += ["", "Summed over %d jobs (%d judged runs): %d kills (%d excused: a first run whose default did not "
              "fit), median %.1f %% of feasible, lowest %.1f %%, %d of %d runs at 95 %% or more." % (
                  s["jobs"], s["runs"], s["kills"], s["excused"], 100 * s["median"], 100 * s["lowest"], s["at_95"],
                  s["runs"])]
    return "\n".join(lines) + "\n"


def job_judged(res: Dict, run: Dict) -> bool:
    return not (run.get("life") == 0 and any(r.get("life") == 1 for r in res["runs"]))


def summary(results: List[Dict]) -> Dict:
    shares = [s for res in results for s in res["judged"]["shares"]]
    return {"jobs": len(results), "runs": len(shares), "kills": sum(r["judged"]["kills"] for r in results),
            "excused": sum(r["judged"]["excused_kills"] for r in results),
            "median": statistics.median(shares) if shares else 0.0, "lowest": min(shares, default=0.0),
            "at_95": sum(1 for s in shares if s >= REACHED)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="the jobs' seed (default: a new one, printed)")
    ap.add_argument("--jobs", type=int, default=30)
    ap.add_argument("--short", action="store_true", help="small groups and short runs, for CI (3 jobs: < 3 min)")
    ap.add_argument("--out", default=None, help="where results.json and table.md go (default: a new temp dir)")
    ap.add_argument("--only", default=None, help="comma-separated job numbers to run (of the seed's jobs)")
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args(argv)
    why = available()
    if why is not None:
        print("exam: %s" % why, file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10 ** 6)
    out = args.out or tempfile.mkdtemp(prefix="memd-exam-")
    os.makedirs(out, exist_ok=True)
    started = time.monotonic()

    def log(text: str) -> None:
        print("[%6.1f s] %s" % (time.monotonic() - started, text), flush=True)

    jobs = generate(seed, args.jobs, args.short, torch_installed())
    if args.only:
        wanted = {int(n) for n in args.only.split(",")}
        jobs = [j for i, j in enumerate(jobs) if i in wanted]
    log("seed %d: %d jobs, results in %s" % (seed, len(jobs), out))
    workdir = tempfile.mkdtemp(prefix="memd-exam-files-")
    daemon = MemdDaemon()
    results: List[Dict] = []
    try:
        for job in jobs:
            log("%s: %s, %s" % (job.name, job.words(), job.method))
            steps = probe_steps(job)
            runs = run_job(job, daemon, workdir, log)
            # A loader's probes run beside what memd's plan ended with (fewer workers, less prefetch)
            ended = [r["loader"] for r in runs if r.get("loader") and not r["killed"]]
            finals = [r["batches"][-1] for r in runs if r["batches"] and not r["killed"]]
            best, probes = feasible(job, steps, workdir, log, ended[-1] if ended else None,
                                    min(finals) if finals else None)
            # A loader's first run starts beside the workers it asked for: whether its default fits
            # there decides whether that run's kill is excused.
            default_fits = None
            if ended and job.default <= best and any(r["killed"] and r.get("life") == 0 for r in runs):
                default_fits = probe(job, job.default, steps, workdir, None)
                log("    probe %d beside the loader it asked for: %s"
                    % (job.default, "ran" if default_fits else "killed"))
            judged = judge(job, best, runs, default_fits)
            log("  feasible %d; %s" % (best, ", ".join("%.1f %%" % (100 * s) for s in judged["shares"])))
            results.append({"job": asdict(job), "words": job.words(), "feasible": best, "probes": probes,
                            "probe_steps": steps, "runs": runs, "judged": judged})
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump({"seed": seed, "short": args.short, "results": results}, f, indent=1)
    finally:
        daemon.stop(keep_log=os.path.join(out, "memd.log"))
        shutil.rmtree(workdir, ignore_errors=True)  # the cache files of jobs the kernel killed
    text = table(seed, results)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    s = dict(summary(results), seed=seed, seconds=round(time.monotonic() - started, 1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f)
    print(text)
    log("done: seed %d, %d kills, median %.1f %%, lowest %.1f %%" % (seed, s["kills"], 100 * s["median"],
                                                                    100 * s["lowest"]))
    return 0


def probe_steps(job: ExamJob) -> int:
    """Steps a probe runs to meet the job's peak: a spike's step, the leak of a whole run."""
    steps = 4
    if job.spec.get("spike_every"):
        steps = max(steps, job.spec["spike_every"] + 1)
    if job.spec.get("leak_kib"):
        steps = max(steps, int(job.seconds * 1000 / max(job.spec.get("step_ms", 0), 1)))
    if job.copies > 1:
        steps = max(steps, 6)
    return min(steps, 600)


if __name__ == "__main__":
    sys.exit(main())

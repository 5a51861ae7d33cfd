"""Real training jobs in real memory cgroups: the largest batch that fits, memd beside the peers.

    sudo .venv/bin/python bench/realjobs.py [--rows gpt-1g,cnn-2g] [--steps 30] [--out DIR]

Each row is a workload (bench/trainjob.py: real PyTorch training on the CPU) in a memory cgroup
of a given size (bench/memcg.py: v1 here, v2 where mounted), created and removed per run. Per row:

- feasible: the largest batch that runs, found by probing: runs of the same job at a fixed batch
  (``--probe-steps``; with workers, until every worker has read each record about five times:
  settled_steps), each in a fresh process in a fresh cgroup of the same size; a kill by the
  kernel's OOM killer means "does not fit". Two pilot runs say where to look; only kills and
  completions decide.
- each method (bench/trainjob.py's --method) in a fresh process and cgroup, ``--steps`` steps:
  memd through the public client (reports, suggest_batch() alone, the training helpers), against
  one real `memd serve` started here with its embedded defaults (``report-restart``: the report
  run again under its job name, a restarted job that starts from what memd learned); accelerate's
  find_executable_batch_size; Lightning's BatchSizeFinder (power, binsearch); the static
  calculators (static-unified: `memd estimate unified`; static-transformer: `memd estimate
  transformer`, for the GPT-style job), run at the batch they print.

Per method: the batch it trained at in the end, as a share of feasible; OOM errors it caught;
OOM kills; the step (and seconds since the process started, imports included) after which its
batch stayed within 5 % of the final one, and the step after which it stayed at 95 % of feasible or
more (a run that overshoots and comes back settles late but may have been near what fits long
before). A killed run's share is 0: what it learned died with it.
Everything in the results is measured: batches the jobs ran, kills the kernel counted, peaks the
kernel reported (VmHWM, the cgroup's max usage); nothing is taken from memd's own predictions.

Writes DIR/results.json, DIR/table.md and DIR/<row>.png (batch per step, per method); with
--log-reads, DIR/reads/<row>-<method>.jsonl: what each method's job held every half second, with
memd's view of it beside (bench/reads.py), and DIR/reads/memd.log, the daemon's log (each change
of batch with what it was decided on), to tell what a plan was decided on from what the job
then held.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

from bench.memcg import MemoryCgroup, available  # noqa: E402
from bench.reads import Reader  # noqa: E402

GiB = 2 ** 30
JOB = os.path.join(ROOT, "bench", "trainjob.py")
MEMD_METHODS = ("report", "suggest", "helpers", "loader")
# memd with reports again, under the job name of the row's "report" run, in the same daemon: the
# job restarted (a preempted Slurm job, a resumed run), which starts from what its first run taught.
RESTART = "report-restart"
PEER_METHODS = ("accelerate", "lightning-power", "lightning-binsearch")
SETTLED = 0.05  # a run has settled once its batch stays within 5 % of its final batch
REACHED = 0.95  # a run is near what fits once its batch stays at this share of feasible or more


@dataclass(frozen=True)
class Row:
    name: str
    shape: str
    limit_bytes: int
    default_batch: int  # what the user would pass as suggest_batch(default=...)
    workers: int = 0  # the DataLoader workers the job asks for (the workers shape)
    # Steps each method runs at least: a worker's copy of the dataset grows as it reads records,
    # so a run that ends before its workers have read them all has not met its peak.
    min_steps: int = 0
    # "cuda": the job trains on the GPU, its pool what another tenant leaves free there
    # (bench/gpujobs.py), not a cgroup: an overshoot is an out-of-memory error, not a kill.
    device: str = "cpu"


# bench/trainjob.py's Records: each worker copies a record as it reads it; after reading each
# about SETTLE_READS times (with replacement), 99 % of them, its memory has levelled. Measured:
# four workers at batch 240 ran the 30 steps of the first probes and were killed at step 31 of
# a longer run; at 160 killed at step 100; at 128 they ran 400 steps (group peak 2040 MiB of 2048).
RECORDS, SETTLE_READS = 1200, 5


def settled_steps(row: "Row", batch: int, steps: int) -> int:
    """Steps for a run at a fixed ``batch`` to meet its peak: ``steps``, or, with workers, enough
    for every worker to have read each record SETTLE_READS times."""
    if not row.workers:
        return steps
    return max(steps, -(-SETTLE_READS * RECORDS * row.workers // batch))


ROWS = {r.name: r for r in (
    Row("gpt-1g", "gpt", 1 * GiB, 4),
    Row("gpt-1.5g", "gpt", 3 * GiB // 2, 4),
    Row("cnn-1g", "cnn", 1 * GiB, 32),
    Row("cnn-2g", "cnn", 2 * GiB, 32),
    Row("embed-8g", "embed", 8 * GiB, 256),
    Row("workers-2g", "workers", 2 * GiB, 32, workers=4, min_steps=200),  # each worker copies the dataset it reads
    # Seed 004's num_workers: 2. Beside four copies the batch's own memory is under a tenth of the
    # 2 GiB (5 % of the feasible batch is 7 MiB, within the pool's 20 MiB margin); beside two,
    # about a third (docs/results.md, the workers rows).
    Row("two-workers-2g", "workers", 2 * GiB, 32, workers=2, min_steps=300),
)}


@dataclass
class Run:
    method: str
    batches: List[int] = field(default_factory=list)  # per training step
    seconds: List[float] = field(default_factory=list)  # since the process started, per step
    hwm: List[int] = field(default_factory=list)  # the process's VmHWM after each step
    trials: List[int] = field(default_factory=list)  # a finder's trial batches, in order
    last_try: Optional[int] = None  # the batch of the last step begun (where a killed run died)
    lengths: List[int] = field(default_factory=list)  # per step, its sequences' tokens (trainjob --lengths)
    last_length: Optional[int] = None  # the tokens of the last step begun, with --lengths
    workers: List[int] = field(default_factory=list)  # per step, when the method chose them (loader)
    reasons: List[str] = field(default_factory=list)
    oom_errors: int = 0
    killed: bool = False
    exit_code: Optional[int] = None
    cgroup_peak_bytes: Optional[int] = None
    wall_seconds: float = 0.0
    note: str = ""
    oom_ended: bool = False  # an out-of-memory error no method caught ended it (on a GPU)

    @property
    def completed(self) -> bool:
        return not self.killed and self.exit_code == 0

    @property
    def out_of_memory(self) -> bool:
        """It did not fit: the kernel killed it, or (on a GPU) an out-of-memory error ended it."""
        return self.killed or self.oom_ended

    def final_batch(self) -> Optional[int]:
        return self.batches[-1] if self.batches and self.completed else None

    def settled_at(self) -> Optional[int]:
        """Index of the step after which the batch stayed within SETTLED of the final one."""
        final = self.final_batch()
        if final is None:
            return None
        at = len(self.batches) - 1
        while at > 0 and abs(self.batches[at - 1] - final) <= SETTLED * final:
            at -= 1
        return at


class OnGpu:
    """A GPU row's pool, in place of a cgroup: what the tenant leaves free on the device
    (bench/gpujobs.py). Nothing there kills; an overshoot ends the job with an error."""
    path = None
    join = None

    def __enter__(self) -> "OnGpu":
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def oom_kills(self) -> int:
        return 0

    def peak_bytes(self) -> Optional[int]:
        return None


def run_job(row: Row, method: str, steps: int, endpoint: Optional[str], extra: List[str] = (),
            timeout: float = 1800.0, reads: Optional[str] = None) -> Run:
    """One process of bench/trainjob.py in a fresh cgroup of the row's size, or on the GPU for a
    GPU row (``reads``: a file for what the job's processes and group hold, read every half
    second: bench/reads.py)."""
    run = Run(method)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if endpoint:
        env["MEMD_ENDPOINT"] = endpoint
    cmd = [sys.executable, JOB, "--shape", row.shape, "--steps", str(steps), "--default-batch",
           str(row.default_batch), "--workers", str(row.workers), "--device", row.device] + list(extra)
    started = time.monotonic()
    pool = OnGpu() if row.device == "cuda" else MemoryCgroup(row.limit_bytes)
    with pool as cg, tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, env=env, preexec_fn=cg.join,
                                start_new_session=True)
        reader = Reader(proc.pid, cg.path, reads, endpoint=endpoint) if reads else None
        try:
            run.exit_code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            run.exit_code = proc.wait()
            run.note = "timed out after %.0f s" % timeout
        finally:
            if reader is not None:
                reader.stop()
        run.killed = cg.oom_kills() > 0
        run.cgroup_peak_bytes = cg.peak_bytes()
        out.seek(0)
        read_events(run, out)
    run.wall_seconds = round(time.monotonic() - started, 1)
    return run


def read_events(run: Run, lines) -> None:
    """What a job's events say of its run. A step begun that neither ended nor was reported as
    an out-of-memory error before the next began was one a finder caught: accelerate and
    Lightning retry on nothing else. (On the CPU a finder's overshoot is a kill; on a GPU,
    accelerate went 128 -> 58 in tenths, an error caught at each.)"""
    begun = False  # a step began and has not ended
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind = event.get("e")
        if kind == "step":
            begun = False
            if "workers" in event:
                run.workers.append(event["workers"])
            run.batches.append(event["batch"])
            if "length" in event:
                run.lengths.append(event["length"])
            run.seconds.append(event["t"])
            run.hwm.append(event["hwm"])
            run.reasons.append(event.get("reason") or "")
        elif kind == "try":
            run.oom_errors += begun
            begun = True
            run.last_try, run.last_length = event["batch"], event.get("length")
        elif kind == "trial":
            begun = begun and "dt" not in event  # Lightning's search steps end in "trial"
            if not run.trials or run.trials[-1] != event["batch"]:
                run.trials.append(event["batch"])
        elif kind == "oom":
            begun = False
            run.oom_errors += 1
        elif kind == "died":
            run.oom_ended = True


PROBE_REPEATS = 1  # runs a batch must complete to fit (--probe-repeats)
RUN_TIMEOUT = 1800.0  # seconds a method's run may take (--timeout)


def fits(row: Row, batch: int, steps: int, log, steady: bool = False):
    """Whether ``batch`` runs: PROBE_REPEATS fresh runs, each completed (the first kill decides).
    Beside workers one run is not the answer: at 7bb7242 the workers row ran 140 once, and at
    266a568 the same run at 140 was killed at its 160th step."""
    for trial in range(PROBE_REPEATS):
        run = run_job(row, "fixed", settled_steps(row, batch, steps), None,
                      ["--method", "fixed", "--batch", str(batch)] + (["--steady-heap"] if steady else []))
        if not run.completed and not run.out_of_memory:
            raise RuntimeError("probe of %s at batch %d failed without a kill (exit %s)" % (row.name, batch,
                                                                                           run.exit_code))
        log("  probe %s batch %d%s%s: %s (%s %s)" % (
            row.name, batch, " (steady heap)" if steady else "",
            " run %d of %d" % (trial + 1, PROBE_REPEATS) if PROBE_REPEATS > 1 else "",
            "runs" if run.completed else "killed" if run.killed else "out of memory",
            "reserved" if row.device == "cuda" else "VmHWM",
            "%.0f MiB" % (max(run.hwm) / 2 ** 20) if run.hwm else "-"))
        if not run.completed:
            break
    return run.completed, run


def feasible(row: Row, steps: int, log, steady: bool = False, guess: Optional[int] = None) -> Dict:
    """The largest batch that runs (``steady``: with glibc's heap held as memd's client holds
    it). Pilot runs at the user's default and four times it give a linear guess, unless one is
    given; from there the batch strides (5 %, doubling) until the answer flips, then bisects to
    1 %. Only kills and completions decide."""
    probes = []

    def test(batch):
        ok, run = fits(row, batch, steps, log, steady)
        probes.append({"batch": batch, "runs": ok, "hwm_bytes": max(run.hwm) if run.hwm else None})
        return ok

    lo, hi = 0, None
    if guess is None:
        small = row.default_batch
        while not test(small):
            if small == 1:
                return {"batch": 0, "first_killed": 1, "probes": probes, "steady_heap": steady}
            small //= 2
        lo, hi = small, 4 * small
        if test(hi):
            p0, p1 = probes[-2]["hwm_bytes"], probes[-1]["hwm_bytes"]
            guess = int(hi + (row.limit_bytes - p1) / max(1.0, (p1 - p0) / (hi - small)))
            lo, hi = hi, None
    if hi is None:
        stride = max(1, int(0.05 * guess))
        batch = max(lo + 1, guess)
        if test(batch):
            lo = batch
            while hi is None:
                batch = lo + stride
                lo, hi = (batch, None) if test(batch) else (lo, batch)
                stride *= 2
        else:
            hi = batch
            while hi - stride > lo:
                if test(hi - stride):
                    lo = hi - stride
                    break
                hi, stride = hi - stride, stride * 2
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if test(mid) else (lo, mid)
    return {"batch": lo, "first_killed": hi, "probes": probes, "steady_heap": steady}


def static_seed000(row: Row) -> int:
    """seed 000's calculator: the batch it prints for this pool (its smallest model; it has no
    entry for these jobs, which is part of the finding)."""
    out = subprocess.run([sys.executable, "-m", "memd", "estimate", "unified", "--memory-gb",
                          "%.3f" % (row.limit_bytes / 1e9), "--model", "sd1", "--resolution", "64", "--json"],
                         capture_output=True, text=True, env=_memd_env())
    if out.returncode not in (0, 1):  # 1: what it prints does not fit; the batch it prints is still its answer
        raise subprocess.CalledProcessError(out.returncode, out.args, out.stdout, out.stderr)
    return json.loads(out.stdout)["batch_size"]


def static_seed003(row: Row) -> Optional[int]:
    """seed 003's transformer estimate: the largest batch whose estimated peak fits the pool."""
    if row.shape != "gpt":
        return None

    def peak(batch):
        out = subprocess.run([sys.executable, "-m", "memd", "estimate", "transformer", "--layers", "2",
                              "--d-model", "128", "--heads", "4", "--vocab", "4096", "--seq-len", "256",
                              "--batch", str(batch), "--device", "cpu", "--json"],
                             capture_output=True, text=True, check=True, env=_memd_env())
        return json.loads(out.stdout)["peak_bytes"]

    lo, hi = 1, 2
    while peak(hi) <= row.limit_bytes:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= row.limit_bytes else (lo, mid)
    return lo


def _memd_env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "client"), env.get("PYTHONPATH", "")])
    return env


class MemdDaemon:
    """The real `memd serve` with its embedded defaults, on a throwaway endpoint and state dir."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="memd-bench-")
        self.endpoint = "ipc://%s/memd.sock" % self.dir
        self.log = open(os.path.join(self.dir, "memd.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "memd", "serve", "--endpoint", self.endpoint,
                                      "--metrics-address", "off", "--state-dir", os.path.join(self.dir, "state")],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=_memd_env())
        from memd.client import DaemonUnavailable, call
        deadline = time.monotonic() + 30
        while True:
            try:
                call("ping", endpoint=self.endpoint, timeout=0.5)
                return
            except DaemonUnavailable:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("memd did not start; see %s/memd.log" % self.dir)
                time.sleep(0.1)

    def stop(self, keep_log: Optional[str] = None) -> None:
        """Stop it and remove its directory, its log copied to ``keep_log`` first if given."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        if keep_log:
            shutil.copyfile(os.path.join(self.dir, "memd.log"), keep_log)
        shutil.rmtree(self.dir, ignore_errors=True)


def bench_row(row: Row, methods: List[str], steps: int, probe_steps: int, daemon: MemdDaemon, log,
              known: Optional[int] = None, known_steady: Optional[int] = None, reads: Optional[str] = None) -> Dict:
    log("row %s: %s in %s" % (row.name, row.shape, pool_words(asdict(row))))
    plain = feasible(row, probe_steps, log) if known is None else {"batch": known, "probes": [], "given": True}
    # memd's client holds glibc's heap steady (a lower, repeatable peak): the job it runs may fit
    # more than the job the peers run. Each method is judged against the larger of the two.
    if row.device == "cuda":  # the GPU's memory is PyTorch's allocator's, not glibc's heap
        steady = dict(plain, steady_heap=True)
    elif known_steady is None:
        steady = feasible(row, probe_steps, log, steady=True, guess=plain["batch"] or None)
    else:
        steady = {"batch": known_steady, "probes": [], "given": True, "steady_heap": True}
    found = dict(max(plain, steady, key=lambda f: f["batch"]), plain=plain, steady=steady)
    log("  feasible: %d (plain heap %d, steady heap %d)" % (found["batch"], plain["batch"], steady["batch"]))
    runs: List[Run] = []
    for method in methods:
        if method == "loader" and row.shape != "workers":
            continue  # MemdLoader reads the workers shape's dataset; the other shapes feed tensors
        if method == RESTART and not any(r.method == "report" for r in runs):
            log("  %s needs this row's report run before it (--methods report,%s)" % (RESTART, RESTART))
            continue
        like = "report" if method == RESTART else method
        extra = ["--method", like if like in MEMD_METHODS + PEER_METHODS else "fixed"]
        if like in MEMD_METHODS:
            extra += ["--job", "bench-%s-%s-%d" % (row.name, like, os.getpid())]
        if method.startswith("static"):
            batch = static_seed000(row) if method in ("static-unified", "static-seed000") else static_seed003(row)
            if batch is None:
                continue
            extra += ["--batch", str(batch)]
        run = run_job(row, method, max(steps, row.min_steps), daemon.endpoint, extra, timeout=RUN_TIMEOUT,
                      reads=os.path.join(reads, "%s-%s.jsonl" % (row.name, method)) if reads else None)
        runs.append(run)
        log("  %-20s %s" % (method, summary_line(run, found["batch"])))
    result = {"row": asdict(row), "feasible": found, "runs": [dict(asdict(r), final_batch=r.final_batch(),
                                                                    settled_step=r.settled_at()) for r in runs]}
    loader = next((r for r in runs if r.method == "loader" and r.completed and r.workers), None)
    if loader is not None:
        # "The most workers that fit": one more than the loader chose, at its batch, must not run
        # (as long as the loader ran: workers grow with the batches they serve). And the batch
        # against the largest that runs beside the workers it chose.
        batch, chose = loader.batches[-1], loader.workers[-1]
        more_row = replace(row, workers=chose + 1)
        more = run_job(more_row, "fixed", settled_steps(more_row, batch, steps), None,
                       ["--method", "fixed", "--batch", str(batch), "--steady-heap"])
        beside = feasible(replace(row, workers=chose), probe_steps, log, steady=True, guess=batch)
        result["workers_check"] = {"batch": batch, "loader_workers": chose, "one_more": chose + 1,
                                   "one_more_runs": more.completed, "one_more_killed": more.killed,
                                   "feasible_beside_chosen": beside}
        log("  %d workers at batch %d (the loader chose %d): %s; the largest batch beside %d: %d" % (
            chose + 1, batch, chose, "runs" if more.completed else "killed", chose, beside["batch"]))
    return result


def cpu_model() -> Optional[str]:
    """The processor's name: machines of one kind differ in it, and a step's seconds with them (the
    GPT job's step at 47 took 1 s on one, 10 s on another, whose products of subnormal numbers
    were 120 times slower than of normal ones)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def machine_meta() -> Dict:
    """What a result was measured on and at which commit (every real-job benchmark's results.json)."""
    import torch
    return {"machine": "%s, %d cores, %.0f GiB, kernel %s" % (
                platform.machine(), os.cpu_count(), os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GiB,
                platform.release()),
            "cpu": cpu_model(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cgroup": "v1" if os.path.isdir("/sys/fs/cgroup/memory") else "v2",
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip() or None}


def summary_line(run: Run, feasible_batch: int) -> str:
    final = run.final_batch()
    if final is None:
        if run.out_of_memory:
            return "%s at batch %s after %d steps" % ("KILLED" if run.killed else "OUT OF MEMORY", run.last_try,
                                                      len(run.batches))
        return "failed (exit %s) %s" % (run.exit_code, run.note)
    at = run.settled_at()
    return "batch %d = %.1f %% of feasible; %d OOM errors; settled at step %d (%.0f s)" % (
        final, 100.0 * final / feasible_batch if feasible_batch else float("nan"), run.oom_errors, at + 1,
        run.seconds[at])


def held_from(batches: List[int], floor: float) -> Optional[int]:
    """Index of the step from which every batch is ``floor`` or more (None if the last is below):
    where settling counts moves around the final batch, this says from when the job ran near what fits."""
    at = len(batches)
    while at > 0 and batches[at - 1] >= floor:
        at -= 1
    return at if at < len(batches) else None


def table(results: List[Dict]) -> str:
    lines = ["| row | pool | feasible | method | batch | of feasible | OOM errors | OOM kills | settled at step "
             "| seconds | at 95 % or more from step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        row, best = res["row"], res["feasible"]["batch"]
        for r in res["runs"]:
            final, at = r["final_batch"], r["settled_step"]
            if final is None:
                ended = r.get("oom_ended")  # an uncaught out-of-memory error on a GPU: counted as an error
                cells = ["killed at %s" % r["last_try"] if r["killed"] else "out of memory at %s" % r["last_try"]
                         if ended else "failed", "0 %", str(r["oom_errors"] + (1 if ended else 0)),
                         "1" if r["killed"] else "0", "-", "-", "-"]
            else:
                workers = r.get("workers") or []
                share = "%.1f %%" % (100.0 * final / best)
                beside = (res.get("workers_check") or {}).get("feasible_beside_chosen") if workers else None
                bar = best
                if beside and beside.get("batch"):  # judged beside the workers it chose, too
                    long = beside.get("long")
                    bar = judged(beside["batch"], long)
                    said = ""
                    if long and bar == long["batch"]:  # judged against what ran as long
                        said = " in %d steps" % long["steps"]
                    elif long:  # still the short probes': what the long runs say so far
                        said = "; %s in %d steps" % (long_known(long), long["steps"])
                    share += " (%.1f %% of the %d that fit beside %d%s)" % (100.0 * final / bar, bar, workers[-1], said)
                reached = held_from(r["batches"], REACHED * bar)
                cells = [str(final) + (" (%d worker%s)" % (workers[-1], "" if workers[-1] == 1 else "s") if workers else ""),
                         share, str(r["oom_errors"]), "0", str(at + 1), "%.0f" % r["seconds"][at],
                         "never" if reached is None else "%d (%.0f s)" % (reached + 1, r["seconds"][reached])]
            lines.append("| %s | %.2f GiB | %s | %s | %s |" % (row["name"], row["limit_bytes"] / GiB, _feasible_cell(res),
                                                               r["method"], " | ".join(cells)))
    return "\n".join(lines) + "\n"


def _feasible_cell(result: Dict) -> str:
    found = result["feasible"]
    plain, steady = found.get("plain"), found.get("steady")
    if plain is None or steady is None or result["row"].get("device") == "cuda":  # no C heap to hold on a GPU
        return str(found["batch"])
    long = found.get("long")  # what ran as long as the methods do (bench/composition.py --record)
    said = "; %s in %d steps" % (long_known(long), long["steps"]) if long else ""
    return "%d (plain heap %d, steady %d%s)" % (found["batch"], plain["batch"], steady["batch"], said)


def judged(short: int, long: Optional[Dict]) -> int:
    """The batch a method is judged against: the short probes', or what ran as long as the method
    did once that is known (three runs of a batch at least, bench/composition.py --record)."""
    return min(short, long["batch"]) if long and long["batch"] is not None else short


def long_known(long: Dict) -> str:
    """What the long runs tell of a row's feasible batch: the batch, or that it is below one."""
    if long["batch"] is not None:
        return str(long["batch"])
    return "below %d" % long["below"] if long.get("below") else "not known"


def pool_words(row: Dict) -> str:
    if row.get("device") == "cuda":
        return "the %.2f GiB another tenant leaves on its GPU" % (row["limit_bytes"] / GiB)
    return "a %.2f GiB cgroup" % (row["limit_bytes"] / GiB)


def plot(result: Dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    best = result["feasible"]["batch"]
    ax.axhline(best, color="black", linestyle="--", linewidth=1, label="feasible (probed): %d" % best)
    for r in result["runs"]:
        if not r["batches"] and not r["trials"]:
            continue
        ys = r["trials"] + r["batches"] if r["method"].startswith(("accelerate", "lightning")) else r["batches"]
        style = "-" if r["method"] in MEMD_METHODS + (RESTART,) else ":"
        label = r["method"] + (" (killed)" if r["killed"] else "")
        ax.plot(range(1, len(ys) + 1), ys, style, marker="x" if r["killed"] else None, label=label)
        if r["killed"] and ys:
            ax.plot([len(ys)], [ys[-1]], "rx", markersize=10)
    row = result["row"]
    ax.set_title("%s in %s: batch per step" % (row["shape"], pool_words(row)))
    ax.set_xlabel("step (finders: trials, then training)")
    ax.set_ylabel("batch size")
    ax.set_yscale("log", base=2)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated: %s" % ", ".join(ROWS))
    parser.add_argument("--methods", default=",".join(MEMD_METHODS + PEER_METHODS + ("static-unified",
                                                                                      "static-transformer")))
    parser.add_argument("--steps", type=int, default=30, help="training steps per method run")
    parser.add_argument("--probe-steps", type=int, default=20,
                        help="steps per probing run (a peak is a draw: a short probe passes batches a long run dies at)")
    parser.add_argument("--probe-repeats", type=int, default=1,
                        help="runs a probed batch must complete to count as fitting (the first kill decides)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a method's run may take (the loader's steps beside one worker take ~3 s)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "real"))
    parser.add_argument("--update", action="store_true",
                        help="replace these rows' runs of these methods in DIR/results.json, keeping the rest "
                             "(each run names the commit it ran; table and plots of all)")
    parser.add_argument("--replot", action="store_true",
                        help="run nothing: rewrite DIR/table.md and the plots from DIR/results.json")
    parser.add_argument("--feasible", default="", metavar="ROW=N,...",
                        help="skip probing for these rows (development only: the published table probes)")
    parser.add_argument("--feasible-steady", default="", metavar="ROW=N,...",
                        help="the same, for the job with the heap held steady as memd's client holds it")
    parser.add_argument("--log-reads", action="store_true",
                        help="write what each method's job holds, read every half second, to DIR/reads/ROW-METHOD.jsonl")
    args = parser.parse_args(argv)
    global PROBE_REPEATS, RUN_TIMEOUT
    PROBE_REPEATS, RUN_TIMEOUT = max(1, args.probe_repeats), args.timeout
    path = os.path.join(args.out, "results.json")
    if args.replot:
        with open(path) as f:
            results = json.load(f)["results"]
        for result in results:
            plot(result, os.path.join(args.out, "%s.png" % result["row"]["name"]))
        return write_table(results, args.out)
    why = available()
    if why:
        print("realjobs: %s" % why, file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: every cgroup made here is removed
    rows = [ROWS[name] for name in args.rows.split(",")]
    known, known_steady = ({name: int(n) for name, _, n in (item.partition("=") for item in given.split(",") if item)}
                           for given in (args.feasible, args.feasible_steady))
    methods = args.methods.split(",")
    os.makedirs(args.out, exist_ok=True)
    log = lambda text: print(text, flush=True)  # noqa: E731
    meta = dict(command="python bench/realjobs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                **machine_meta(), date=time.strftime("%Y-%m-%d"), steps=args.steps, probe_steps=args.probe_steps,
                probe_repeats=PROBE_REPEATS)
    reads = os.path.join(args.out, "reads") if args.log_reads else None
    if reads:
        os.makedirs(reads, exist_ok=True)
    daemon = MemdDaemon()
    results, metas = [], {}
    if args.update and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        results, metas = old["results"], old.get("metas", {r["row"]["name"]: old["meta"] for r in old["results"]})
    try:
        for row in rows:
            result = bench_row(row, methods, args.steps, args.probe_steps, daemon, log, known.get(row.name),
                               known_steady.get(row.name), reads)
            for run in result["runs"]:
                run["commit"] = meta["commit"]
            before = next((r for r in results if r["row"]["name"] == row.name), None)
            if before is not None:
                result = updated(before, result, methods)
            results = [r for r in results if r["row"]["name"] != row.name] + [result]
            results.sort(key=lambda r: list(ROWS).index(r["row"]["name"]) if r["row"]["name"] in ROWS else 99)
            metas[row.name] = meta
            plot(result, os.path.join(args.out, "%s.png" % row.name))
            with open(path, "w") as f:
                json.dump({"meta": meta, "metas": metas, "results": results}, f, indent=1)
    finally:
        daemon.stop(keep_log=os.path.join(reads, "memd.log") if reads else None)  # its batch_changed lines
    return write_table(results, args.out)


def updated(before: Dict, result: Dict, methods: List[str]) -> Dict:
    """A row run again with --update: the methods not run now keep their runs, the ones run again
    keep theirs as ``earlier_runs`` (newest first, each with its commit), and a feasible batch
    given as found keeps the probes that found it."""
    order = [*MEMD_METHODS, *PEER_METHODS]
    kept = [r for r in before["runs"] if r["method"] not in methods]
    result["runs"] = sorted(kept + result["runs"], key=lambda r: order.index(r["method"]) if r["method"] in order else 99)
    result["earlier_runs"] = [r for r in before["runs"] if r["method"] in methods] + before.get("earlier_runs", [])
    if "workers_check" not in result and "loader" not in methods and "workers_check" in before:
        result["workers_check"] = before["workers_check"]
    new, old = result["feasible"], before["feasible"]
    if new.get("given") and all(new[k]["batch"] == old.get(k, {}).get("batch") for k in ("plain", "steady")):
        result["feasible"] = old
    return result


def write_table(results: List[Dict], out: str) -> int:
    text = table(results)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One generated job of the exam (bench/exam.py): a real process whose steps really touch memory.

    python bench/examjob.py --spec '{"fixed_mib": 200, "sample_kib": 4096}' --method suggest --steps 60

A step of batch b touches sample_kib KiB a sample plus quad_bytes x b^2 (attention scores) of
fresh memory, holds it for the step and gives it back, the way a training step's activations
come and go. Where that memory lives (``kind``):
  private  anonymous private pages (mmap), returned at the step's end
  heap     the C heap: 32 KiB Python bytes objects, freed at the step's end (glibc keeps some)
  shared   anonymous shared pages (MAP_SHARED: shmem, as a DataLoader's batches)
  shm      a file in /dev/shm (unlinked as it is made, as PyTorch shares tensors), unmapped at the
           step's end
  torch    torch tensors (four a step), as PyTorch's CPU allocator gets them
  cache    private pages as "private", and the step also reads a file of cache_mib MiB (page cache,
           charged to the job's group, which the kernel reclaims before it kills)
Besides: fixed_mib held from the start (the model, the optimizer), a spike (the step memory x
spike on one step in spike_every), a leak (leak_kib kept each step), step_ms (a step lasts at
least this), torch (import torch first: a heavy import, its libraries mapped).

Methods (where the batch comes from): fixed (--batch, every step: a probe), suggest
(client.suggest_batch(default) alone, once a step), session (Session.plan(), then
report(batch, peak_bytes=None): the daemon measures), loader (MemdLoader over a dataset of
sample_kib tensors; the step's own memory beside the batch the loader delivers).

--neighbour runs no job: a process that holds --neighbour-schedule's MiB, "t:mib,t:mib,...",
moving linearly between the points (seconds since it started), until it is killed.

Every step prints {"e": "try", "batch"} before it starts and {"e": "step", "i", "batch", "t",
"hwm"} after it (``t``: seconds since the process started, imports included; ``hwm``: the
step's peak, its VmRSS read with all of its memory touched; VmHWM is left to memd, which reads
and resets it). A killed job prints nothing more.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time

T0 = time.monotonic()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "client")]

KiB, MiB = 1024, 1024 * 1024
PAGE = mmap.PAGESIZE
CHUNK = 32 * KiB  # a heap object: under glibc's mmap threshold, so it lives in the heap


def emit(**fields) -> None:
    fields.setdefault("t", round(time.monotonic() - T0, 3))
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * KiB
    return 0


def touch(buf) -> None:
    """Write every page of a writable buffer (memset in C: a GiB in a fraction of a second)."""
    size = len(buf)
    if size:
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(buf)), 1, size)


class Pages:
    """``size`` bytes of resident memory of one kind, given back by close()."""

    def __init__(self, kind: str, size: int, torch_module=None):
        self.kind, self.size = kind, max(PAGE, int(size) // PAGE * PAGE)
        self.maps, self.objects = [], []
        if kind in ("private", "cache"):
            self.maps.append(mmap.mmap(-1, self.size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        elif kind == "shared":
            self.maps.append(mmap.mmap(-1, self.size, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS))
        elif kind == "shm":
            # As PyTorch's file_descriptor sharing does: created in /dev/shm and unlinked at once,
            # so a job the kernel kills leaves nothing there.
            path = "/dev/shm/memd-exam-%d-%d" % (os.getpid(), id(self))
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.unlink(path)
                os.ftruncate(fd, self.size)
                self.maps.append(mmap.mmap(fd, self.size, mmap.MAP_SHARED))
            finally:
                os.close(fd)
        elif kind == "heap":
            self.objects = [b"\x01" * CHUNK for _ in range(self.size // CHUNK)]
        elif kind == "torch":
            quarter = self.size // 4
            self.objects = [torch_module.ones(quarter, dtype=torch_module.uint8) for _ in range(4)]
        else:
            raise SystemExit("unknown kind %r" % kind)
        for m in self.maps:
            touch(m)

    def close(self) -> None:
        for m in self.maps:
            m.close()
        self.maps, self.objects = [], []


class Job:
    def __init__(self, spec: dict, workdir: str):
        self.spec = spec
        self.torch = None
        if spec.get("torch") or spec.get("kind") == "torch":
            import torch  # the heavy import: hundreds of MB of libraries mapped
            torch.set_num_threads(1)
            self.torch = torch
        self.fixed = Pages("private", spec.get("fixed_mib", 0) * MiB) if spec.get("fixed_mib") else None
        self.leaked = []
        self.cache_file = None
        if spec.get("cache_mib"):
            self.cache_file = os.path.join(workdir, "memd-exam-cache-%d" % os.getpid())
            with open(self.cache_file, "wb") as f:
                block = b"\x02" * MiB
                for _ in range(int(spec["cache_mib"])):
                    f.write(block)

    def step_bytes(self, batch: int, i: int) -> int:
        spec = self.spec
        size = spec.get("sample_kib", 0) * KiB * batch + spec.get("quad_bytes", 0) * batch * batch
        every = spec.get("spike_every")
        if every and i % every == every - 1:
            size = int(size * spec.get("spike", 1.0))
        return int(size)

    def step(self, batch: int, i: int, extra: int = 0) -> int:
        """One step; returns its peak resident set (read with all of its memory touched)."""
        started = time.monotonic()
        held = Pages(self.spec.get("kind", "private"), max(0, self.step_bytes(batch, i) - extra), self.torch)
        if self.cache_file is not None:
            with open(self.cache_file, "rb", buffering=0) as f:
                while f.read(MiB):
                    pass
        if self.spec.get("leak_kib"):
            self.leaked.append(Pages("private", self.spec["leak_kib"] * KiB))
        peak = status_bytes("VmRSS:")  # the step's memory all resident: its peak
        pad = self.spec.get("step_ms", 0) / 1000.0 - (time.monotonic() - started)
        if pad > 0:
            time.sleep(pad)
        held.close()
        return peak

    def close(self) -> None:
        if self.cache_file is not None:
            try:
                os.unlink(self.cache_file)
            except OSError:
                pass


def run(job: Job, steps: int, seconds: float, batch_for, after=None) -> None:
    deadline = time.monotonic() + seconds
    for i in range(steps):
        if time.monotonic() > deadline:
            break
        batch = batch_for(i)
        emit(e="try", batch=batch)
        emit(e="step", i=i, batch=batch, hwm=job.step(batch, i))
        if after is not None:
            after(batch)
    emit(e="done")


class FixedPlan:
    """A plan that never moves, for a probe: --batch beside --workers workers at --prefetch (the
    configuration memd's plan ended with, else those asked for at a DataLoader's default 2); no
    daemon is asked. MemdLoader over it is the loader's own job at one batch (its workers forked
    and its batches held as it holds them). bench/trainjob.py's loader probes use it too."""

    def __init__(self, batch: int, workers: int, prefetch: int):
        from memd.client import Plan

        self.target_effective_batch, self.min_batch = None, 1
        self._plan = Plan(batch_size=batch, grad_accum_steps=1, effective_batch_size=batch, num_workers=workers,
                          prefetch_factor=prefetch if workers else None, throttle=False, pressure="ok",
                          reason="fixed", source="fixed")

    def plan(self):
        return self._plan

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def method_loader(job: Job, args) -> None:
    """MemdLoader over a dataset of sample_kib tensors: the batch it delivers is part of the step's
    memory, the rest (the activations) is allocated beside it."""
    from memd import client
    from memd.client.training import MemdLoader

    torch = job.torch
    if torch is None:
        raise SystemExit("--method loader needs torch in the spec")
    floats = max(1, int(job.spec.get("sample_kib", 1) * KiB // 4))

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 1 << 20

        def __getitem__(self, i):
            return torch.full((floats,), float(i % 7))

    deadline = time.monotonic() + args.seconds
    workers = job.spec.get("workers", 1) if args.workers is None else args.workers
    with (FixedPlan(args.batch, workers, args.prefetch or 2) if args.batch else
          client.Session(job=args.job, default_batch=args.default_batch, num_workers=workers)) as s:
        loader = MemdLoader(Samples(), s, shuffle=False, drop_last=True, report=not args.batch)
        i = 0
        for batch in loader:
            if i >= args.steps or time.monotonic() > deadline:
                break
            n = len(batch)
            emit(e="try", batch=n)
            plan = loader.plan
            emit(e="step", i=i, batch=n, hwm=job.step(n, i, extra=n * floats * 4), workers=plan.num_workers,
                 prefetch=plan.prefetch_factor)
            del batch
            i += 1
    emit(e="done")


def neighbour(schedule: str) -> None:
    """Hold the schedule's MiB, "t:mib,...": linear between its points, the last held."""
    points = sorted((float(t), float(m)) for t, m in (p.split(":") for p in schedule.split(",")))
    held = []  # 4 MiB pieces
    while True:
        now = time.monotonic() - T0
        want = points[-1][1]
        for (t0, m0), (t1, m1) in zip(points, points[1:]):
            if t0 <= now < t1:
                want = m0 + (m1 - m0) * (now - t0) / (t1 - t0)
                break
        if now < points[0][0]:
            want = points[0][1]
        pieces = int(want // 4)
        while len(held) < pieces:
            held.append(Pages("private", 4 * MiB))
        while len(held) > pieces:
            held.pop().close()
        time.sleep(0.02)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="{}", help="the job's shape, as JSON (see above)")
    ap.add_argument("--method", choices=("fixed", "suggest", "session", "loader"), default="fixed")
    ap.add_argument("--batch", type=int, default=None, help="fixed: the batch of every step")
    ap.add_argument("--default-batch", type=int, default=32)
    ap.add_argument("--job", default="exam")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seconds", type=float, default=600.0, help="stop after this long (steps or seconds, first)")
    ap.add_argument("--workdir", default="/tmp")
    ap.add_argument("--neighbour", metavar="SCHEDULE", default=None)
    ap.add_argument("--workers", type=int, default=None, help="loader with --batch: its workers (default: the spec's)")
    ap.add_argument("--prefetch", type=int, default=None, help="loader with --batch: their prefetch (default 2)")
    args = ap.parse_args(argv)
    if args.neighbour:
        neighbour(args.neighbour)
        return 0
    job = Job(json.loads(args.spec), args.workdir)
    emit(e="ready", rss=status_bytes("VmRSS:"))
    try:
        if args.method == "fixed":
            run(job, args.steps, args.seconds, lambda i: args.batch)
        elif args.method == "suggest":
            from memd import client
            run(job, args.steps, args.seconds, lambda i: client.suggest_batch(default=args.default_batch, job=args.job))
        elif args.method == "session":
            from memd import client
            with client.Session(job=args.job, default_batch=args.default_batch) as s:
                last = []

                def planned(i):
                    batch = s.plan().batch_size
                    if last and last[-1] != batch:
                        client.trim_heap()  # as README's loop does at a change of batch
                    last[:] = [batch]
                    return batch

                run(job, args.steps, args.seconds, planned,
                    lambda batch: s.report(batch_size=batch, peak_bytes=None))
        else:
            method_loader(job, args)
    finally:
        job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MemdLoader against the real daemon, with real DataLoader workers (forked processes)."""
import functools
import json
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
from memd import client  # noqa: E402
from memd.client.training import MemdLoader  # noqa: E402
from realdaemon import memd_env, wait_for  # noqa: E402


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 203  # not a multiple of any batch: the last batch is short

    def __getitem__(self, i):
        return torch.tensor([i])


def test_a_rebuild_mid_epoch_loses_and_repeats_no_sample(memd):
    """Two real workers, a shuffled epoch; an out-of-memory error mid-epoch makes the daemon cut
    the batch (8 -> 6): the loader is rebuilt there, and every sample comes exactly once."""
    with client.Session("loader-rebuild", endpoint=memd.endpoint, timeout=1.0, default_batch=8, num_workers=2) as s:
        loader = MemdLoader(Numbers(), s, shuffle=True, report=False)
        seen, sizes = [], []
        for i, batch in enumerate(loader):
            seen.extend(int(v) for v in batch.flatten())
            sizes.append(len(batch))
            if i == 5:
                s.report_oom(batch_size=8)  # waits for the daemon's smaller plan
        assert loader.builds == 2 and loader.plan.num_workers == 2
        assert sizes[:6] == [8] * 6 and set(sizes[6:-1]) == {6}, sizes
        assert sorted(seen) == list(range(203))  # none lost, none repeated
        again = [int(v) for batch in loader for v in batch.flatten()]  # the next epoch, same workers
        assert sorted(again) == list(range(203)) and loader.builds == 2


class ScriptedSession:
    """Plans from a script, one per batch. A stand-in for the daemon (whose plans depend on
    measured memory): what is under test is the loader's answer to a plan, with real workers."""

    def __init__(self, sizes, workers=2):
        self.sizes, self.workers, self.asked = list(sizes), workers, 0
        self.target_effective_batch, self.min_batch = None, 1

    def plan(self):
        size = self.sizes[min(self.asked, len(self.sizes) - 1)]
        self.asked += 1
        return client.Plan(batch_size=size, grad_accum_steps=1, effective_batch_size=size, num_workers=self.workers,
                           prefetch_factor=2, throttle=False, pressure="ok", reason="scripted", source="daemon")

    def report(self, *args, **kwargs):
        pass


def test_a_growing_batch_keeps_the_workers_and_a_shrinking_one_rebuilds():
    """Growth, and a cut of less than a tenth, reach the workers without a rebuild (each forked
    worker keeps what it copied of the dataset; a rebuild forks new ones that copy it again):
    batches prefetched at the old size come first, then the new ones. A deeper cut rebuilds at
    once. Every sample comes exactly once."""
    session = ScriptedSession([8] * 4 + [20] * 3 + [19] * 5 + [5])
    loader = MemdLoader(Numbers(), session, shuffle=True, report=False)
    seen, sizes = [], []
    for batch in loader:
        seen.extend(int(v) for v in batch.flatten())
        sizes.append(len(batch))
    assert sorted(seen) == list(range(203))  # none lost, none repeated
    assert loader.builds == 2, sizes  # growth and the 5 % cut kept the DataLoader; only the deep cut rebuilt it
    grown = sizes.index(20)
    assert set(sizes[:grown]) == {8} and grown <= 4 + 2 * 2, sizes  # at most workers x prefetch at the old size
    assert 19 in sizes and 5 in sizes and sizes[-2:] != [19, 19], sizes  # both cuts reached the loader


def test_a_new_epoch_takes_a_small_change_without_a_rebuild():
    """At an epoch's first batch as between two others: growth and a small cut keep the workers
    (a rebuild forks new ones that copy the dataset again). Before, a new size there rebuilt."""
    session = ScriptedSession([20] * 11 + [19] * 11 + [25])  # 203 samples: 11 batches of 20
    loader = MemdLoader(Numbers(), session, shuffle=True, report=False)
    epochs = [[len(batch) for batch in loader] for _ in range(3)]
    assert loader.builds == 1, epochs
    assert set(epochs[0][:-1]) == {20} and set(epochs[1][2:-1]) == {19} and 25 in epochs[2], epochs


class Wide(torch.utils.data.Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        return torch.full((2048,), float(i))  # 8 KiB


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads a worker's descriptors in /proc")
def test_a_rebuild_forks_its_new_workers_without_the_batch_the_loop_holds():
    """A fork inherits the trainer's descriptor of every shared batch it holds, and such a batch
    then lives as long as the new worker does (bench/rebuildpin.py: 29.3 MiB for the run's rest).
    The batch the loop held across the rebuild keeps its values, in the trainer's own memory."""
    loader = MemdLoader(Wide(), ScriptedSession([40] * 3 + [10] * 8, workers=1), report=False)
    held = None
    for i, batch in enumerate(loader):
        if len(batch) == 40:
            held, values = batch, batch.clone()
        if i == 6:
            break
    assert loader.builds == 2
    worker = loader._loader._iterator._workers[0].pid
    from bench.rebuildpin import inherited

    assert inherited(worker) == []
    assert not held.is_shared() and torch.equal(held, values)


FORKED_PAGES = r"""
import gc, json, sys, time
import torch
from test_loader import Numbers, ScriptedSession
from memd.client.training import MemdLoader
from memd.sampling.procs import read_process

def own_mib(pid):  # what the process alone maps (USS)
    return read_process(pid).uss_bytes / 2 ** 20

def collection_copies(worker):
    time.sleep(0.2)
    before = own_mib(worker)
    gc.collect()
    return own_mib(worker) - before

objects = [[(i, j) for j in range(50)] for i in range(20000)]  # a million tracked tuples, ~70 MiB
plain = iter(torch.utils.data.DataLoader(Numbers(), batch_size=4, num_workers=1, persistent_workers=True))
next(plain)
unfrozen = collection_copies(plain._workers[0].pid)
del plain
loader = MemdLoader(Numbers(), ScriptedSession([4], workers=1), report=False)
batches = iter(loader)
next(batches)
print(json.dumps({"unfrozen": unfrozen, "memd": collection_copies(loader._loader._iterator._workers[0].pid)}))
"""


def test_its_workers_keep_sharing_what_they_were_forked_with_through_a_collection():
    """A full collection writes into every object Python tracks, and a page a forked worker
    still shares is copied when either process writes to it (the benchmark's MemdLoader beside
    one worker was killed 4 s after such a copy of 66 MiB). Beside a plain DataLoader a
    collection in the trainer copies tens of MiB of the worker's pages; beside MemdLoader's,
    whose objects were frozen as the workers started, next to none. In a fresh process: a
    freeze is for the whole process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    out = subprocess.run([sys.executable, "-c", FORKED_PAGES], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    copied = json.loads(out.stdout.strip().splitlines()[-1])
    assert copied["unfrozen"] > 30 and copied["memd"] < 3, copied


class Scratch(torch.utils.data.Dataset):
    """Each sample frees most of what it allocates in the worker's C heap, one block of it kept
    above the rest (a long-lived allocation), so the freed blocks are holes the heap's top
    cannot give back."""

    kept = []

    def __len__(self):
        return 8

    def __getitem__(self, i):
        blocks = [bytes(4096) for _ in range(2000)]  # 8 MiB, below any mmap threshold: the heap
        Scratch.kept.append(bytes(4096))
        del blocks
        time.sleep(0.02)
        return torch.tensor([i])


class Samples(torch.utils.data.Dataset):
    """Samples of 8 KiB, in the worker's C heap; the last of each batch of 1,000 leaves a block
    of its own above them (a long-lived allocation), so the heap's top cannot give them back."""

    kept = []

    def __len__(self):
        return 4000

    def __getitem__(self, i):
        if i % 1000 == 999:
            Samples.kept.append(bytes(4096))
            time.sleep(0.05)  # a batch that takes a while to build: a trim is cheap beside it
        return torch.full((2048,), float(i))


def worker_heap(loader, batch):
    """MiB in the C heap of ``loader``'s one worker, read once it has built its last batch of the
    epoch (nothing more to build). Compared between loaders: each worker also holds a few MiB of
    the heap this process had when it forked."""
    from bench.reads import heap_private

    batches = iter(loader)
    assert [len(b) for b in batches] == [batch] * (len(loader.dataset) // batch)
    worker = loader._loader._iterator._workers[0] if isinstance(loader, MemdLoader) else batches._workers[0]
    return heap_private(worker.pid)


WORKER_HEAPS = r"""
import json
import torch
from test_loader import Samples, Scratch, ScriptedSession, worker_heap
from memd.client.training import MemdLoader

def samples(**kwargs):
    return worker_heap(MemdLoader(Samples(), ScriptedSession([1000], workers=1), report=False, **kwargs), 1000)

print(json.dumps({
    "held": worker_heap(torch.utils.data.DataLoader(Scratch(), batch_size=2, num_workers=1, prefetch_factor=1,
                                                    persistent_workers=True), 2),
    "trimmed": worker_heap(MemdLoader(Scratch(), ScriptedSession([2], workers=1), report=False), 2),
    "trimmed_only": samples(collate_fn=torch.utils.data.default_collate),
    "freed": samples(),
}))
"""


@functools.lru_cache(maxsize=None)
def worker_heaps():
    """The loaders' workers' heaps, read in a fresh process: forked from this one, a worker's
    heap is what the tests before left in it (in the full suite, a worker that only trimmed held
    5 MiB where alone it held 10)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    out = subprocess.run([sys.executable, "-c", WORKER_HEAPS], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads a worker's heap in /proc")
def test_its_workers_give_their_heaps_free_pages_back():
    """A worker's freed blocks stay resident in its C heap unless it is trimmed; MemdLoader's
    workers trim after each batch they collate."""
    heaps = worker_heaps()
    assert heaps["held"] - heaps["trimmed"] >= 5, heaps  # 8 MiB of holes


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads a worker's heap in /proc")
def test_its_workers_free_a_batchs_samples_before_they_trim():
    """A batch's samples are freed once collated, not after the trim: the 8 MiB of samples of
    each batch of 1,000, pinned under a block one of them keeps, go back to the kernel. With a
    collate_fn of the loop's own (which may keep its samples) the worker only trims."""
    heaps = worker_heaps()
    assert heaps["trimmed_only"] - heaps["freed"] >= 5, heaps


def test_a_job_with_no_hint_gets_workers(memd):
    """No num_workers anywhere: the DataLoader's own suggestion, as many as the CPUs it may use."""
    with client.Session("loader-default", endpoint=memd.endpoint, timeout=1.0, default_batch=4) as s:
        plan = s.plan()
        assert plan.source == "daemon"
        assert plan.num_workers == client.usable_cpus() >= 1 and plan.prefetch_factor == 2, plan
        loader = MemdLoader(Numbers(), s, report=False)
        assert len(next(iter(loader))) == 4 and loader.plan.num_workers >= 1


def test_each_batch_reports_the_step_before_it(memd):
    """Iterating is the loop: each step is reported as the loop asks for the next batch, before
    that batch is fetched, with its batch's bytes, and the daemon measures what it cost."""
    with client.Session("loader-report", endpoint=memd.endpoint, timeout=1.0, default_batch=8, max_batch=8,
                        num_workers=1) as s:
        for _ in MemdLoader(Numbers(), s):
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            view = next(v for v in memd.call("status")["sessions"] if v["job"] == "loader-report")
            if view["reports"] == 26:
                break
            time.sleep(0.05)
        assert view["reports"] == 26  # 26 batches, each step reported as the next is asked for (the last too)


def test_a_step_is_reported_before_the_next_batch_is_fetched():
    """The daemon measures a reported step's peak when the report arrives: sent after the next
    batch was collated, a step at 27 was measured at the next one's collate at 36, the step at 36
    a third below its peak, and a plan grown on that was killed (bench/exam.py, a loader job in
    2.25 GiB). With no workers the batch is fetched in the loop's own process, as there."""
    events = []

    class Logged(Numbers):
        def __getitem__(self, i):
            events.append(("fetch", i))
            return super().__getitem__(i)

    class Recorded(ScriptedSession):
        def report(self, size, **kwargs):
            events.append(("report", size))

    for _ in MemdLoader(Logged(), Recorded([4], workers=0)):
        pass
    reports = [i for i, e in enumerate(events) if e[0] == "report"]
    assert len(reports) == 51  # every step: 203 samples in batches of 4, the last one short
    fetched_before = [sum(1 for e in events[:i] if e[0] == "fetch") for i in reports]
    assert fetched_before == [4 * (n + 1) for n in range(50)] + [203]  # each after its own batch, before the next


def test_a_batch_that_ran_out_of_memory_is_not_reported_clean(memd):
    """loader.report_oom(): the daemon cuts the batch at once, and that step never counts as clean."""
    with client.Session("loader-oom", endpoint=memd.endpoint, timeout=1.0, default_batch=8, num_workers=0) as s:
        loader = MemdLoader(Numbers(), s)
        sizes = []
        for i, batch in enumerate(loader):
            sizes.append(len(batch))
            if i == 2:
                loader.report_oom()
        assert sizes[:3] == [8] * 3 and sizes[3] == 6, sizes
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            view = next(v for v in memd.call("status")["sessions"] if v["job"] == "loader-oom")
            if view["reports"] >= len(sizes) - 1:
                break
            time.sleep(0.05)
        assert (view["ooms"], view["reports"]) == (1, len(sizes) - 1)  # every step but the one that failed


THROTTLED_JOB = r"""
import json, os, sys, threading, time
import torch
from memd import client
from memd.client.training import MemdLoader

group = sys.argv[1]
def room():  # what memd counts as free in the group: its limit less what it cannot give back
    stat = dict(line.split() for line in open(os.path.join(group, "memory.stat")))
    cache = int(stat["total_active_file"]) + int(stat["total_inactive_file"]) - int(stat["total_mapped_file"])
    usage = int(open(os.path.join(group, "memory.usage_in_bytes")).read())
    return int(open(os.path.join(group, "memory.limit_in_bytes")).read()) - (usage - max(0, cache))

class Numbers(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i): return torch.tensor([i])

s = client.Session("throttled", default_batch=4, timeout=1.0)
s.plan()
ballast = []
limit = int(open(os.path.join(group, "memory.limit_in_bytes")).read())
# The group all but full (under half its 8 MiB margin): memd's critical level for this job.
while room() > 0.004 * limit:
    block = bytearray(max(4096, min(2 << 20, room() - int(0.004 * limit) + 4096)))
    block[::4096] = b"x" * len(block[::4096])
    ballast.append(block)
deadline = time.monotonic() + 10
while not s.plan().throttle and time.monotonic() < deadline:
    time.sleep(0.05)
throttled = s.plan().throttle
def release():
    time.sleep(1.5)
    ballast.clear()
threading.Thread(target=release).start()
started = time.monotonic()
loader = MemdLoader(Numbers(), s, report=False, throttle_wait=10)
first = next(iter(loader))
print(json.dumps({"throttled": throttled, "waited": time.monotonic() - started, "after": loader.plan.throttle}))
"""


@pytest.mark.skipif(not os.access("/sys/fs/cgroup/memory", os.W_OK),
                    reason="needs a writable cgroup v1 memory controller")
def test_throttle_pauses_fetching_until_memory_is_back(memd):
    """A real job fills its real 700 MiB cgroup: the daemon plans `throttle` for it, the loader
    fetches nothing until the job frees its ballast, then goes on by itself."""
    from bench import memcg

    with memcg.MemoryCgroup(700 * 2 ** 20) as cg:
        out = subprocess.run([sys.executable, "-c", THROTTLED_JOB, cg.path],
                             env=memd_env({"MEMD_ENDPOINT": memd.endpoint}), capture_output=True, text=True,
                             timeout=120, preexec_fn=cg.join)
        assert cg.oom_kills() == 0
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["throttled"] is True
    assert 1.4 <= result["waited"] < 10 and result["after"] is False, result


WORKERS_JOB = r"""
import time
import torch
from memd import client

class Rows(torch.utils.data.Dataset):  # Python objects: each forked worker copies what it reads
    def __init__(self):
        self.rows = [[float(i)] * 1024 for i in range(2048)]
    def __len__(self):
        return len(self.rows)
    def __getitem__(self, i):
        return torch.tensor(self.rows[i][:4])

with client.Session("with-workers", default_batch=8, timeout=1.0) as s:
    batches = iter(torch.utils.data.DataLoader(Rows(), batch_size=8, num_workers=2, persistent_workers=True))
    print("running", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # a loop that asks and reports each step, until the test is done
        next(batches)
        s.report(batch_size=s.plan().batch_size, peak_bytes=300 * 2 ** 20)
        time.sleep(0.05)
"""


def test_status_shows_the_workers_a_plan_was_made_beside(memd):
    """A real job with two real DataLoader workers (forked, copying its dataset as they read it):
    `status` shows the workers its latest plan saw, and `memd status` says so in a line."""
    job = subprocess.Popen([sys.executable, "-c", WORKERS_JOB], env=memd_env({"MEMD_ENDPOINT": memd.endpoint}),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "running", job.stderr.read()[-2000:]

        def seen():
            view = next((v for v in memd.call("status")["sessions"] if v["job"] == "with-workers"), None)
            return view if view and view["workers"] and len(view["workers"]["own_bytes"]) == 2 else None

        view = wait_for(seen, timeout=20)
        assert view, memd.call("status")["sessions"]
        workers = view["workers"]
        assert workers["running"] == 2 and all(b > 0 for b in workers["own_bytes"]), workers
        assert workers["cost_bytes"] >= min(workers["own_bytes"]) and workers["follows_plan"] is False
        assert workers["levelled"] in (True, False) and (not workers["levelled"] or workers["level_bytes"])
        assert view["pool_budget_bytes"] >= view["budget_bytes"]
        out = subprocess.run([sys.executable, "-m", "memd", "status", "--endpoint", memd.endpoint],
                             env=memd_env(), capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "workers: 2 running, holding " in out.stdout, out.stdout
    finally:
        job.kill()
        job.wait(10)

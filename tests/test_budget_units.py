"""Free and held in one unit, read off real processes: the trainer holds its resident set less the
file pages it maps (page cache, which its pool counts as reclaimable), and the daemon's measure of
its peak leaves them out the same way.

A job in a 1 GiB group whose trainer mapped 6.5 MiB of files was budgeted 1028 MiB: its file
pages counted free (page cache) and held (in its RSS). With torch imported a trainer maps 78 MiB
of libraries (217 MiB of RSS); in a 3 GiB group the README's loop was budgeted 101.6 % of it.
"""
import os
import subprocess
import sys

import pytest

from bench import memcg
from memd.config import PolicyConfig
from memd.policy.budget import host_pool
from memd.sampling import procs
from memd.sampling.sampler import Sampler

MiB = 2 ** 20
# A process that maps (and reads) a file of 48 MiB and holds 64 MiB of its own, then waits.
HOLDER = """
import mmap, sys
with open(sys.argv[1], "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    total = sum(mapped[i] for i in range(0, len(mapped), 4096))
held = bytearray(b"\\x01" * (64 << 20))
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    path = tmp_path / "mapped"
    path.write_bytes(b"\x02" * (48 * MiB))

    def start(preexec_fn=None):
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
        assert proc.stdout.readline().strip() == "ready"
        started.append(proc)
        return proc

    started = []
    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_trainer_holds_its_resident_set_less_its_file_pages(holder):
    proc = holder()
    job = Sampler(gpus=None).job(proc.pid)
    assert job.trainer_file_bytes >= 48 * MiB  # the mapped file, and the interpreter's own libraries
    assert job.trainer_held_bytes == job.trainer_rss_bytes - job.trainer_file_bytes
    assert 64 * MiB <= job.trainer_held_bytes <= 64 * MiB + 32 * MiB
    # its measured peak leaves the same pages out
    peak = procs.read_peak(proc.pid)
    hwm = procs.read_peak_rss(proc.pid)
    assert hwm - job.trainer_file_bytes - MiB <= peak <= hwm - 48 * MiB


@pytest.mark.skipif(memcg.available() is not None, reason="needs a writable memory cgroup (root)")
def test_a_budget_in_a_real_group_stays_within_its_limit_less_the_margin(holder, tmp_path):
    """The file's pages are charged to the group that read them (this one, or the test's if the file
    was cached already): counted once, the budget stays within the limit less the margin."""
    with memcg.MemoryCgroup(256 * MiB) as cg:
        proc = holder(preexec_fn=cg.join)
        sampler = Sampler(gpus=None)
        job = sampler.job(proc.pid)
        pool = host_pool(sampler.sample(), job, PolicyConfig())
        assert pool.capacity_bytes == 256 * MiB
        budget = pool.budget(held_peak=procs.read_peak(proc.pid))
        assert budget <= 256 * MiB - pool.margin_bytes
        # what the job could still add is what its group has free: about 256 MiB less its 64 and the interpreter
        assert 256 * MiB - 120 * MiB <= budget - job.trainer_held_bytes <= 256 * MiB - 64 * MiB


def test_the_host_pool_pairs_free_memory_with_the_trainer():
    """On the host the free memory is read with the trainer (MemAvailable beside its status), not
    from the sampler's snapshot of another instant."""
    job = Sampler(gpus=None).job(os.getpid())
    assert job.available_bytes is not None and job.available_bytes > 0
    assert job.trainer_rss_bytes > 0 and job.trainer_file_bytes is not None and job.paired_at is None
    again = Sampler(gpus=None).paired(job)  # between reads of the tree: the pair alone, read again
    assert again.processes == job.processes and again.paired_at is not None and again.available_bytes > 0


# A process that holds 32 MiB, and 128 MiB more each time it reads a line.
GROWER = """
import sys
held = [bytearray(b"\\x01" * (32 << 20))]
print("ready", flush=True)
for line in sys.stdin:
    held.append(bytearray(b"\\x01" * (128 << 20)))
    print("grown", flush=True)
"""


@pytest.mark.skipif(memcg.available() is not None, reason="needs a writable memory cgroup (root)")
def test_the_jobs_of_one_group_are_read_together_so_one_is_never_the_others_neighbour():
    """Two jobs of one group, each read with the group at its own instant: one that grew between
    its read and the other's counted as memory outside both (a neighbour's growth, held back from
    the other's budget). Two copies whose steps each map and free 0.8 GiB were cut to half their
    batch read after read. Read with one read of the group, what lies outside is what it was."""
    sampler = Sampler(gpus=None)

    def outside(jobs):
        assert len({j.cgroup.usage_bytes for j in jobs}) == 1  # one read of the group
        return jobs[0].cgroup.usage_bytes - sum(j.trainer_held_bytes for j in jobs)

    with memcg.MemoryCgroup(768 * MiB) as cg:
        started = [subprocess.Popen([sys.executable, "-c", GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True, preexec_fn=cg.join) for _ in range(2)]
        try:
            assert [p.stdout.readline().strip() for p in started] == ["ready", "ready"]
            a, b = (sampler.job(p.pid) for p in started)
            before = outside(sampler.paired_pool([a, b]))
            b = sampler.paired(b)
            started[1].stdin.write("grow\n")
            started[1].stdin.flush()
            assert started[1].stdout.readline().strip() == "grown"
            a = sampler.paired(a)  # b's 128 MiB in the group's read, not in b's
            assert a.cgroup.usage_bytes - a.trainer_held_bytes - b.trainer_held_bytes >= before + 120 * MiB
            together = sampler.paired_pool([a, b])
            assert {j.paired_at for j in together} == {together[0].paired_at}
            assert abs(outside(together) - before) <= 8 * MiB
        finally:
            for p in started:
                p.kill()
                p.wait()


# A process that maps 64 MiB of a /dev/shm file (a step's shared tensors); at a line on stdin it
# unmaps them, the file kept: its pages stay charged to the group, as a step's do until the
# kernel frees them.
SHM_HOLDER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 64 << 20)
m = mmap.mmap(fd, 64 << 20, flags=mmap.MAP_SHARED)
for i in range(0, len(m), 4096):
    m[i] = 1
print("ready", flush=True)
sys.stdin.readline()
m.close()
print("unmapped", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(memcg.available() is not None, reason="needs a writable memory cgroup (root)")
def test_shared_memory_a_trainer_just_unmapped_is_its_own_and_never_anothers():
    """The group's shared memory no trainer maps is what a step just unmapped: the trainer's that
    let go of it, until the kernel frees it. Beside another trainer of the group, taken by each as
    its own (or the other's mapped pages as one's own unmapped), two jobs whose steps held 0.8 GiB
    of /dev/shm each were claimed a step high and cut to half, read after read (bench/exam.py)."""
    sampler = Sampler(gpus=None)
    files = ["/dev/shm/memd-test-units-%d-%d" % (os.getpid(), i) for i in range(2)]
    with memcg.MemoryCgroup(512 * MiB) as cg:
        started = [subprocess.Popen([sys.executable, "-c", SHM_HOLDER, f], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, preexec_fn=cg.join) for f in files]
        try:
            assert [p.stdout.readline().strip() for p in started] == ["ready", "ready"]
            jobs = sampler.paired_pool([sampler.job(p.pid) for p in started])
            assert jobs[0].cgroup.shmem_bytes >= 128 * MiB and [j.unmapped_shmem_bytes for j in jobs] == [0, 0]
            started[1].stdin.write("\n")
            started[1].stdin.flush()
            assert started[1].stdout.readline().strip() == "unmapped"
            jobs = sampler.paired_pool(jobs)
            assert jobs[1].trainer_shmem_bytes < 4 * MiB and jobs[0].trainer_shmem_bytes >= 64 * MiB
            assert jobs[0].unmapped_shmem_bytes == 0
            assert 60 * MiB <= jobs[1].unmapped_shmem_bytes <= 64 * MiB
        finally:
            for p in started:
                p.kill()
                p.wait()
            for f in files:
                if os.path.exists(f):
                    os.unlink(f)

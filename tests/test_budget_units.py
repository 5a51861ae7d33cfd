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

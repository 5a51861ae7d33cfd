"""The memory pressure in a job's own cgroup, read by the real daemon from a real group."""
import os
import subprocess
import sys

import pytest

from realdaemon import memd_env, wait_for

MiB = 2 ** 20

# A job that maps a file larger than the room its group leaves it and reads it over and over:
# the kernel evicts the file's pages to make room for the next ones, and the job waits on every
# page it reads back. It asks memd for plans meanwhile, as a training loop would. It reads the
# file as random access does, a page a fault: with readahead each fault brought back some 10,000
# pages, 25-30 faults a second beside a running benchmark, at the edge of what the daemon calls
# thrashing (256 in 10 s), and a fresh clone's run saw no critical in 90 s; a page a fault makes
# 10,000-17,000 a second here.
THRASHING_JOB = r"""
import mmap, sys, time
from memd import client

s = client.Session("thrashing", default_batch=8, timeout=1.0)
s.plan()
ballast = bytearray(48 << 20)
ballast[::4096] = b"x" * len(ballast[::4096])
with open(sys.argv[1], "rb") as f:
    pages = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
pages.madvise(mmap.MADV_RANDOM)
print("running", flush=True)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:  # until the test is done
    sum(pages[i] for i in range(0, len(pages), 4096))
    s.plan()
"""


@pytest.mark.skipif(not os.access("/sys/fs/cgroup/memory", os.W_OK),
                    reason="needs a writable cgroup v1 memory controller (root)")
def test_a_job_thrashing_its_own_cgroup_is_critical_there(memd, tmp_path):
    """A real job thrashes its real 160 MiB group v1 (a 128 MiB file read over and over beside
    48 MiB of its own): the daemon reads the group's refaults and major faults, calls the
    pressure in it critical, and plans the job throttled; the group is not killed, only slow.
    Before it reads the file, the group is at ok. (The host's PSI sees the stalls too here, the
    job being most of what runs.)"""
    from bench import memcg

    data = tmp_path / "data"
    with open(data, "wb") as f:
        for i in range(128):
            f.write(bytes([i]) * MiB)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # read in by the job, charged to its group
    with memcg.MemoryCgroup(160 * MiB) as cg:
        job = subprocess.Popen([sys.executable, "-c", THRASHING_JOB, str(data)], preexec_fn=cg.join,
                               env=memd_env({"MEMD_ENDPOINT": memd.endpoint}), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            assert job.stdout.readline().strip() == "running", job.stderr.read()[-2000:]

            def session():
                return next((v for v in memd.call("status")["sessions"] if v["job"] == "thrashing"), None)

            assert session() is not None and session()["cgroup_pressure_level"] == "ok"
            seen = wait_for(lambda: (session() or {}).get("cgroup_pressure_level") == "critical" and session(),
                            timeout=90, step=0.25)
            assert seen, session()
            plan = seen["plan"]
            assert plan["pressure"] == "critical" and plan["throttle"], plan
            out = subprocess.run([sys.executable, "-m", "memd", "status", "--endpoint", memd.endpoint],
                                 env=memd_env(), capture_output=True, text=True, timeout=30)
            assert "memory pressure in its own cgroup: critical" in out.stdout, out.stdout
            assert cg.oom_kills() == 0
        finally:
            job.kill()
            job.wait(10)
            calm_host()


def calm_host(timeout: float = 90.0) -> None:
    """Wait until the host's PSI has come down from this test's stalls: the next test's daemon
    reads it (run next in a fresh clone, `memd top`'s test saw the host critical and its job
    cut)."""
    from memd.sampling.system import read_pressure

    def calm():
        psi = read_pressure()
        return psi is None or (psi.some_avg10 < 0.02 and psi.full_avg10 < 0.02)

    wait_for(calm, timeout=timeout, step=0.5)

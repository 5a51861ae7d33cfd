"""Sampling against fixture /proc and cgroup trees, and against real processes and cgroups."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from memd.sampling import cgroup, procs, system
from memd.sampling.sampler import Sampler
from nobody import as_nobody
from realdaemon import run_memd

MB = 10 ** 6
MiB = 2 ** 20


# -- PSI and meminfo ---------------------------------------------------------------------------

PSI = "some avg10=12.50 avg60=3.00 avg300=0.75 total=4500000\nfull avg10=1.00 avg60=0.20 avg300=0.05 total=900000\n"


def test_parse_pressure_gives_ratios_and_seconds():
    p = system.parse_pressure(PSI)
    assert (p.some_avg10, p.some_avg60, p.full_avg10) == (0.125, 0.03, 0.01)
    assert (p.some_total_seconds, p.full_total_seconds) == (4.5, 0.9)
    with pytest.raises(ValueError):
        system.parse_pressure("garbage")


def write(root, rel, text):
    path = os.path.join(str(root), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_no_psi_is_none_not_zero(tmp_path):
    write(tmp_path, "meminfo", "MemTotal: 1000 kB\nMemFree: 100 kB\nMemAvailable: 400 kB\n")
    assert system.read_pressure(str(tmp_path)) is None
    mem = system.read_meminfo(str(tmp_path))
    assert (mem.total_bytes, mem.available_bytes, mem.used_bytes) == (1024000, 409600, 614400)


def test_psi_switched_off_is_told_from_an_unreadable_file():
    """Booted with psi=0 the PSI files exist and reading them fails EOPNOTSUPP (EINVAL on some
    kernels): no PSI, as without the files. Any other error is a failed read, counted as one.
    One rule for the host's file and a cgroup's."""
    import errno

    assert system.psi_disabled(OSError(errno.EOPNOTSUPP, "Operation not supported"))
    assert system.psi_disabled(OSError(errno.EINVAL, "Invalid argument"))
    assert not system.psi_disabled(OSError(errno.EACCES, "Permission denied"))
    assert not system.psi_disabled(OSError("no errno"))


def test_the_host_total_is_read_one_way_for_the_sampler_and_doctor(tmp_path):
    from memd.sampling import capabilities

    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 600 kB\nSwapTotal: 0 kB\n")
    assert system.read_host_memory(str(tmp_path)).total_bytes == 1000 * 1024 == \
        capabilities.host_total_bytes(str(tmp_path))
    assert capabilities.host_total_bytes(str(tmp_path / "none")) is None


def test_unreadable_entries_become_errors_not_crashes(tmp_path):
    write(tmp_path, "meminfo", "MemTotal: 1000 kB\nMemAvailable: 400 kB\n")
    write(tmp_path, "pressure/memory", "not psi at all\n")
    write(tmp_path, "vmstat", "oom_kill 3\n")
    snap = Sampler(proc_root=str(tmp_path)).sample()
    assert snap.system.total_bytes == 1024000
    assert snap.pressure is None and snap.oom_kills == 3
    sources = {source for source, _ in snap.errors}
    assert "pressure" in sources and "cgroup" in sources  # no cgroup files in the fixture either


# -- cgroups -----------------------------------------------------------------------------------

V1_MOUNTINFO = "35 31 0:32 / {root}/sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
V2_MOUNTINFO = "41 31 0:38 / {root}/sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n"


def mount_cgroup(root, version, membership, pid="self"):
    """A fixture /proc that mounts cgroup v1 (memory) or v2 under root, with ``pid`` in
    ``membership`` (the /proc/PID/cgroup text); returns the hierarchy's directory."""
    write(root, "proc/self/mountinfo", (V1_MOUNTINFO if version == 1 else V2_MOUNTINFO).format(root=root))
    write(root, "proc/%s/cgroup" % pid, membership)
    return "sys/fs/cgroup/memory/" if version == 1 else "sys/fs/cgroup/"


def test_cgroup_v1_limit_usage_and_working_set(tmp_path):
    root = str(tmp_path)
    d = mount_cgroup(root, 1, "4:memory:/slurm/job42\n0::/\n") + "slurm/job42/"
    write(root, d + "memory.limit_in_bytes", "1073741824\n")
    write(root, d + "memory.usage_in_bytes", "600000000\n")
    write(root, d + "memory.stat", "hierarchical_memory_limit 1073741824\ntotal_inactive_file 100000000\n"
          "total_active_file 150000000\ntotal_mapped_file 40000000\n")
    write(root, d + "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    cg = cgroup.read_cgroup(proc_root=root + "/proc")
    assert (cg.version, cg.path, cg.limit_bytes, cg.usage_bytes) == (1, "/slurm/job42", 1073741824, 600000000)
    assert cg.working_set_bytes == 500000000 and cg.oom_kill_events == 2
    # Every file page, mapped or not, is what the kernel takes back before it kills.
    assert cg.reclaimable_bytes == 100000000 + 150000000
    assert cg.mapped_file_bytes == 40000000  # of those, the ones a process maps (the job's code, budget.group_margin)


def test_mapped_file_pages_are_reclaimable(tmp_path):
    """The benchmark's workers job at batch 138 in a 2 GiB group v1 (c458298): its memory.stat
    read 21 MiB of active file pages, 189 inactive and 52 mapped, 5 s in. Reaching its limit, the
    kernel took its file pages to about 10 MiB, the mapped ones to 5-8, and the job finished: all
    210 are reclaimable, not the 158 nobody maps."""
    root, MiB = str(tmp_path), 2 ** 20
    d = mount_cgroup(root, 1, "4:memory:/memd-bench\n") + "memd-bench/"
    write(root, d + "memory.usage_in_bytes", "%d\n" % (1369 * MiB))
    write(root, d + "memory.stat", "hierarchical_memory_limit %d\ncache %d\nrss %d\nshmem %d\n"
          "total_active_file %d\ntotal_inactive_file %d\ntotal_mapped_file %d\n" % (
              2048 * MiB, 250 * MiB, 1110 * MiB, 38 * MiB, 21 * MiB, 189 * MiB, 52 * MiB))
    assert cgroup.read_cgroup(proc_root=root + "/proc").reclaimable_bytes == 210 * MiB
    assert cgroup.read_cgroup(proc_root=root + "/proc").shmem_bytes == 38 * MiB  # v1's own, no total_ line


@pytest.mark.skipif(not os.access("/sys/fs/cgroup/memory", os.W_OK),
                    reason="needs a writable cgroup v1 memory controller (root)")
def test_the_batches_on_their_way_are_told_from_the_processes_own_memory(tmp_path):
    """A real process tree in a real cgroup holds what a DataLoader's does: a batch written to
    shared memory and let go of (a memfd kept open, mapped by nobody); a segment the trainer
    maps and its forked worker shares; and a batch the worker is collating, mapped by it alone.
    The batches on their way are the first and the last; the last is in the worker's USS, and
    not its own memory: its cost is the rest."""
    from bench import memcg

    holder = (
        "import mmap, os, sys, time\n"
        "def shm(name, mib):\n"
        "    fd = os.memfd_create(name)\n"
        "    os.ftruncate(fd, mib << 20)\n"
        "    m = mmap.mmap(fd, mib << 20)\n"
        "    m.write(b'x' * (mib << 20))\n"
        "    return fd, m\n"
        "queued, m = shm('queued', 32)\n"
        "m.close()\n"
        "mapped, kept = shm('mapped', 16)\n"
        "if os.fork() == 0:\n"
        "    sum(kept[i] for i in range(0, 16 << 20, 4096))  # a fork maps shared pages as it touches them\n"
        "    collating, batch = shm('collating', 8)\n"
        "    print('ready', os.getpid(), flush=True)\n"
        "time.sleep(60)\n")
    MiB = 2 ** 20
    with memcg.MemoryCgroup(512 * MiB) as cg:
        proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True,
                                preexec_fn=cg.join)
        try:
            word, worker = proc.stdout.readline().split()
            assert word == "ready"
            job = Sampler().job(proc.pid)
            trainer, = [p for p in job.processes if p.pid == proc.pid]
            child, = [p for p in job.processes if p.pid == int(worker)]
            assert job.cgroup is not None and job.cgroup.shmem_bytes >= 56 * MiB
            assert 8 * MiB <= trainer.shmem_bytes < 9 * MiB and trainer.private_shmem_bytes < MiB  # half of 16, shared
            assert 16 * MiB <= child.shmem_bytes < 17 * MiB  # the other half, and its own 8
            assert 8 * MiB <= child.private_shmem_bytes < 9 * MiB
            assert child.uss_bytes >= 8 * MiB and job.worker_bytes == [child.uss_bytes - child.private_shmem_bytes]
            assert 40 * MiB <= job.in_flight_shmem_bytes < 43 * MiB  # 32 let go of, 8 being collated
        finally:
            proc.kill()
            proc.wait()


def test_cgroup_v1_unlimited_is_none(tmp_path):
    root = str(tmp_path)
    d = mount_cgroup(root, 1, "4:memory:/\n")
    write(root, d + "memory.stat", "hierarchical_memory_limit 9223372036854771712\ntotal_inactive_file 0\n")
    write(root, d + "memory.usage_in_bytes", "5\n")
    assert cgroup.read_cgroup(proc_root=root + "/proc").limit_bytes is None


def test_cgroup_v2_parent_limit_binds_and_events_pressure(tmp_path):
    root = str(tmp_path)
    base = mount_cgroup(root, 2, "0::/kubepods/pod1/ctr\n", pid=1234)
    write(root, base + "cgroup.controllers", "cpu memory pids\n")
    write(root, base + "kubepods/pod1/memory.max", "1073741824\n")
    write(root, base + "kubepods/pod1/memory.high", "max\n")
    write(root, base + "kubepods/pod1/ctr/memory.max", "max\n")
    write(root, base + "kubepods/pod1/ctr/memory.high", "900000000\n")
    write(root, base + "kubepods/pod1/ctr/memory.current", "700000000\n")
    write(root, base + "kubepods/pod1/ctr/memory.stat", "anon 500000000\ninactive_file 150000000\n"
          "active_file 30000000\nfile_mapped 20000000\nshmem 4000000\n")
    write(root, base + "kubepods/pod1/ctr/memory.events", "low 0\nhigh 4\nmax 9\noom 2\noom_kill 1\n")
    write(root, base + "kubepods/pod1/ctr/memory.pressure", PSI)
    cg = cgroup.read_cgroup(1234, proc_root=root + "/proc")
    assert (cg.version, cg.limit_bytes, cg.high_bytes) == (2, 1073741824, 900000000)
    assert (cg.usage_bytes, cg.working_set_bytes) == (700000000, 550000000)
    assert cg.reclaimable_bytes == 150000000 + 30000000 and cg.shmem_bytes == 4000000
    assert cg.mapped_file_bytes == 20000000
    assert (cg.oom_events, cg.oom_kill_events) == (2, 1)
    assert cg.pressure.some_avg10 == 0.125


def test_cgroup_v2_without_memory_controller_is_none(tmp_path):
    root = str(tmp_path)
    write(root, mount_cgroup(root, 2, "0::/\n") + "cgroup.controllers", "cpu pids\n")
    assert cgroup.read_cgroup(proc_root=root + "/proc") is None


def _v1_memory_root():
    path = "/sys/fs/cgroup/memory"
    return path if os.path.isdir(path) and os.access(path, os.W_OK) else None


@pytest.mark.skipif(_v1_memory_root() is None, reason="needs a writable cgroup v1 memory controller (root)")
def test_sample_inside_a_real_1gib_cgroup():
    """`memd sample --json` run inside a real cgroup with a 1 GiB limit reports exactly that."""
    group = os.path.join(_v1_memory_root(), "memd-test-%s" % uuid.uuid4().hex[:8])
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(1 << 30))
        cmd = [sys.executable, "-c", "import os, sys, runpy; open(%r, 'w').write(str(os.getpid())); "
               "sys.argv = ['memd', 'sample', '--json']; runpy.run_module('memd', run_name='__main__')"
               % os.path.join(group, "cgroup.procs")]
        out = run_memd_raw(cmd)
        data = json.loads(out)
        assert data["cgroup"]["version"] == 1
        assert data["cgroup"]["limit_bytes"] == 1073741824
        assert data["cgroup"]["usage_bytes"] > 0
    finally:
        time.sleep(0.1)
        os.rmdir(group)


def run_memd_raw(cmd):
    from realdaemon import memd_env
    out = subprocess.run(cmd, env=memd_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


# -- process trees -----------------------------------------------------------------------------

TREE_SCRIPT = r"""
import os, sys, time
shared = bytearray(200 * 1024 * 1024)          # the parent's 200 MB, shared copy-on-write
for i in range(0, len(shared), 4096): shared[i] = 1
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        own = bytearray(100 * 1024 * 1024)     # each child's own 100 MB
        for i in range(0, len(own), 4096): own[i] = 1
        x = shared[0]
        sys.stdout.write("ready\n"); sys.stdout.flush()
        time.sleep(60); os._exit(0)
    kids.append(pid)
time.sleep(60)
"""


def test_process_tree_separates_shared_from_own_memory():
    parent = subprocess.Popen([sys.executable, "-c", TREE_SCRIPT], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        for _ in range(3):
            assert parent.stdout.readline().strip() == "ready"
        tree = procs.read_tree(parent.pid)
        assert not tree.errors
        assert len(tree.processes) == 4 and tree.processes[0].pid == parent.pid
        children = tree.processes[1:]
        for child in children:
            assert child.ppid == parent.pid
            assert abs(child.uss_bytes - 100 * MiB) <= 0.15 * 100 * MiB, child
            assert child.rss_bytes >= child.uss_bytes + 150 * MiB  # RSS counts the shared 200 MB too
            # all it could come to own by writing: its 100 MB and the parent's 200 MB, not the libraries
            assert child.uss_bytes + 150 * MiB <= child.anon_bytes <= child.rss_bytes, child
        pss_total = tree.total("pss_bytes")
        rss_total = tree.total("rss_bytes")
        assert pss_total < rss_total - 400 * MiB  # PSS counts the shared pages once, RSS four times
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        parent.wait()


def test_a_job_that_started_the_daemon_does_not_count_it_among_its_processes():
    """A test or a notebook that starts `memd serve` and opens a session for its own pid: the
    daemon is its child, and was read as one of its dataloader workers. The job's tree leaves
    out the daemon's process and what it started."""
    daemon = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    try:
        for _ in range(100):  # until the shell has started its sleep
            if procs.children(daemon.pid):
                break
            time.sleep(0.01)
        sleeper = procs.children(daemon.pid)
        assert sleeper
        whole = procs.read_tree(os.getpid()).pids
        assert daemon.pid in whole and sleeper[0] in whole
        skipped = procs.read_tree(os.getpid(), skip=(daemon.pid,)).pids
        assert os.getpid() in skipped and daemon.pid not in skipped and sleeper[0] not in skipped
        assert procs.read_tree(daemon.pid, skip=(daemon.pid,)).pids[0] == daemon.pid  # the job itself stays
    finally:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()


def test_vanished_process_is_a_partial_answer_not_an_exception():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    tree = procs.read_tree(proc.pid)
    assert tree.processes == () and "vanished" in tree.errors[0][1]


def test_tree_of_fixture_proc(tmp_path):
    root = str(tmp_path)
    write(root, "10/stat", "10 (trainer) S 1 10 10 0 -1 0 0 0 0 0 0 0 0 0 20 0 3 0 500 0 0\n")
    write(root, "10/smaps_rollup", "Rss: 3000 kB\nPss: 2000 kB\nPss_Shmem: 300 kB\nPrivate_Clean: 100 kB\n"
                                   "Private_Dirty: 900 kB\nAnonymous: 1200 kB\n")
    write(root, "10/status", "Name:\ttrainer\nRssShmem:\t400 kB\n")
    write(root, "10/task/10/children", "11 12")
    write(root, "10/task/13/children", "")
    write(root, "11/stat", "11 (pt_data_worker (0)) S 10 10 10 0 -1 0 0 0 0 0 %d %d 0 0 20 0 1 0 600 0 0\n" % (
        3 * procs.CLOCK_TICKS, procs.CLOCK_TICKS // 2))  # 3 s user, 0.5 s system
    write(root, "11/smaps_rollup", "Rss: 2500 kB\nPss: 1000 kB\nPrivate_Dirty: 200 kB\n")
    write(root, "11/task/11/children", "")
    # 12 vanished between the children read and its own read
    tree = procs.read_tree(10, proc_root=root, gpu_bytes={11: 5 * MB})
    assert [p.pid for p in tree.processes] == [10, 11]
    assert tree.processes[1].name == "pt_data_worker (0)"
    assert (tree.processes[0].rss_bytes, tree.processes[0].pss_bytes, tree.processes[0].uss_bytes) == (
        3000 * 1024, 2000 * 1024, 1000 * 1024)
    assert tree.processes[1].gpu_bytes == 5 * MB
    assert (tree.processes[0].anon_bytes, tree.processes[1].anon_bytes) == (1200 * 1024, None)
    assert (tree.processes[0].cpu_seconds, tree.processes[1].cpu_seconds) == (0.0, 3.5)
    assert (tree.processes[0].shmem_bytes, tree.processes[1].shmem_bytes) == (300 * 1024, None)  # before 5.13: none
    # 300 kB split by sharers of 400 mapped: at least 200 of it is its alone, the rest half each.
    assert (tree.processes[0].private_shmem_bytes, tree.processes[1].private_shmem_bytes) == (200 * 1024, None)
    assert tree.errors == (("procs", "process 12 vanished during the scan"),)
    assert procs.process_start_time(10, root) == 500


def test_memd_sample_pid_reports_the_tree_with_gpu_field():
    parent = subprocess.Popen([sys.executable, "-c", "import os, time; os.fork(); time.sleep(30)"],
                              start_new_session=True)
    try:
        time.sleep(0.3)
        data = json.loads(run_memd(["sample", "--json", "--pid", str(parent.pid)]).stdout)
        assert len(data["processes"]) == 2
        assert set(data["processes"][0]) == {"pid", "ppid", "name", "rss_bytes", "pss_bytes", "uss_bytes", "gpu_bytes",
                                               "anon_bytes", "cpu_seconds", "shmem_bytes",
                                               "private_shmem_bytes"}
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_cgroup_v1_unlimited_on_64k_page_kernels_is_none(tmp_path):
    """arm64/ppc64le kernels with 64 KiB pages round "no limit" down to 0x7FFFFFFFFFFF0000."""
    root = str(tmp_path)
    d = mount_cgroup(root, 1, "4:memory:/\n")
    write(root, d + "memory.usage_in_bytes", "5\n")
    for unlimited, real in ((0x7FFFFFFFFFFF0000, 2 ** 40), (2 ** 62, 2 ** 62 - 2 ** 16)):
        write(root, d + "memory.stat", "hierarchical_memory_limit %d\ntotal_inactive_file 0\n" % unlimited)
        assert cgroup.read_cgroup(proc_root=root + "/proc").limit_bytes is None
        write(root, d + "memory.stat", "hierarchical_memory_limit %d\ntotal_inactive_file 0\n" % real)
        assert cgroup.read_cgroup(proc_root=root + "/proc").limit_bytes == real


# -- process trees without smaps_rollup ---------------------------------------------------------

PAGE = os.sysconf("SC_PAGE_SIZE")


def fixture_process(root, pid, ppid, name, children=(), statm=True, rollup=None):
    write(root, "%d/stat" % pid, "%d (%s) S %d %d %d 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 500 0 0\n"
          % (pid, name, ppid, pid, pid))
    write(root, "%d/task/%d/children" % (pid, pid), " ".join(str(c) for c in children))
    if statm:
        write(root, "%d/statm" % pid, "9000 %d 300 1 0 500 0\n" % (pid * 10))  # resident pages
    if rollup is not None:
        write(root, "%d/smaps_rollup" % pid, rollup)


def test_tree_on_a_kernel_without_smaps_rollup_is_rss_only_said_once(tmp_path):
    """Before 4.14 there is no smaps_rollup: every process keeps its statm RSS, the children
    are still walked, and the reason is one entry for the tree."""
    root = str(tmp_path)
    fixture_process(root, 10, 1, "trainer", children=(11, 12, 13))
    fixture_process(root, 11, 10, "worker 0", children=(14,))
    fixture_process(root, 12, 10, "worker 1")
    fixture_process(root, 14, 11, "grandchild")
    fixture_process(root, 13, 10, "gone", statm=False)  # exited between stat and statm
    tree = procs.read_tree(10, proc_root=root)
    assert tree.pids == (10, 11, 12, 14)
    assert [p.rss_bytes for p in tree.processes] == [100 * PAGE, 110 * PAGE, 120 * PAGE, 140 * PAGE]
    assert all(p.pss_bytes is None and p.uss_bytes is None for p in tree.processes)
    assert tree.errors == (
        ("procs", "process 13 vanished during the scan"),
        ("procs", "%s: PSS/USS unknown, RSS from statm for 4 processes (10, 11, 12, 14)" % procs.NO_SMAPS_ROLLUP),
    )
    assert procs.read_tree(10, proc_root=root, detail=False).errors == (
        ("procs", "process 13 vanished during the scan"),)  # RSS was all that was asked for


def test_tree_where_some_processes_have_smaps_rollup_names_only_the_others(tmp_path):
    root = str(tmp_path)
    fixture_process(root, 10, 1, "trainer", children=(11,), rollup="Rss: 3000 kB\nPss: 2000 kB\n")
    fixture_process(root, 11, 10, "worker")
    tree = procs.read_tree(10, proc_root=root)
    assert [(p.rss_bytes, p.pss_bytes) for p in tree.processes] == [(3000 * 1024, 2000 * 1024), (110 * PAGE, None)]
    assert tree.errors == (("procs", "%s: PSS/USS unknown, RSS from statm for 1 process (11)" % procs.NO_SMAPS_ROLLUP),)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file; the test below covers root")
def test_unreadable_smaps_rollup_is_rss_with_a_reason(tmp_path):
    root = str(tmp_path)
    fixture_process(root, 10, 1, "trainer", children=(11,), rollup="Rss: 3000 kB\n")
    fixture_process(root, 11, 10, "worker", rollup="Rss: 2000 kB\n")
    os.chmod(os.path.join(root, "10", "smaps_rollup"), 0)
    tree = procs.read_tree(10, proc_root=root)
    assert [(p.rss_bytes, p.pss_bytes) for p in tree.processes] == [(100 * PAGE, None), (2000 * 1024, None)]
    assert tree.errors == (("procs", "%s: PSS/USS unknown, RSS from statm for 1 process (10)"
                            % procs.SMAPS_ROLLUP_DENIED),)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_another_users_job_is_rss_with_a_reason():
    """A daemon without CAP_SYS_PTRACE reading a root-owned job: RSS for both processes, and
    the reason once, naming them."""
    job = subprocess.Popen([sys.executable, "-c", "import os, sys, time\nif os.fork() == 0: time.sleep(60)\n"
                            "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"],
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert job.stdout.readline().strip() == "ready"
        def read_roots_job():
            tree = procs.read_tree(job.pid)
            return [[[p.pid, p.rss_bytes, p.pss_bytes] for p in tree.processes], tree.errors]

        processes, errors = as_nobody(read_roots_job)
        assert len(processes) == 2 and processes[0][0] == job.pid
        assert all(rss > 0 and pss is None for _, rss, pss in processes)
        assert errors == [["procs", "%s: PSS/USS unknown, RSS from statm for 2 processes (%d, %d)"
                           % (procs.SMAPS_ROLLUP_DENIED, job.pid, processes[1][0])]]
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


# -- GPU memory per process ----------------------------------------------------------------------

def gpu(index, *processes):
    from memd.sampling.snapshot import Gpu, GpuProcess
    return Gpu(index, "GPU-%d" % index, "L4", 24 * MiB, 0, 24 * MiB, 0, False,
               processes=tuple(GpuProcess(pid, used) for pid, used in processes))


def test_gpu_bytes_unknown_on_one_device_is_unknown_in_all():
    from memd.sampling.sampler import gpu_bytes_by_pid
    gpus = [gpu(0, (7, 3 * MiB), (8, 1 * MiB), (9, None)), gpu(1, (7, None), (8, 2 * MiB), (9, 5 * MiB))]
    assert gpu_bytes_by_pid(gpus) == {7: None, 8: 3 * MiB, 9: None}
    assert gpu_bytes_by_pid([gpu(0, (8, 0))]) == {8: 0}  # zero is known, not unknown


def test_a_processs_gpu_memory_unknown_on_one_device_is_unknown(tmp_path):
    root = str(tmp_path)
    fixture_process(root, 10, 1, "trainer", children=(11,))
    fixture_process(root, 11, 10, "worker")
    sampler = Sampler(proc_root=root, etc_root=root, apple_silicon=False)
    both_known = sampler.job(10, [gpu(0, (10, 3 * MiB)), gpu(1, (10, 2 * MiB), (11, 1 * MiB))])
    assert [p.gpu_bytes for p in both_known.processes] == [5 * MiB, 1 * MiB]
    partly = sampler.job(10, [gpu(0, (10, 3 * MiB)), gpu(1, (10, None), (11, 1 * MiB))])
    assert [p.gpu_bytes for p in partly.processes] == [None, 1 * MiB]  # not 3 MiB passed off as the total
    assert [p.gpu_bytes for p in sampler.job(10, []).processes] == [None, None]  # no GPU: nothing known


# -- a job's own cgroup --------------------------------------------------------------------------

def test_job_cgroup_is_the_jobs_own_not_the_daemons(tmp_path):
    """memd.service is unlimited; the job runs in a Slurm step limited to 2 GiB."""
    root = str(tmp_path)
    proc = os.path.join(root, "proc")
    write(root, "proc/meminfo", "MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n")
    base = mount_cgroup(root, 2, "0::/system.slice/memd.service\n")
    fixture_process(proc, 42, 1, "trainer", rollup="Rss: 3000 kB\nPss: 2000 kB\n")
    write(root, "proc/42/cgroup", "0::/slurm/job7/step0\n")
    write(root, base + "cgroup.controllers", "cpu memory pids\n")
    write(root, base + "system.slice/memd.service/memory.max", "max\n")
    write(root, base + "system.slice/memd.service/memory.current", "50000000\n")
    write(root, base + "slurm/job7/memory.max", "%d\n" % (2 * 2 ** 30))
    write(root, base + "slurm/job7/step0/memory.max", "max\n")
    write(root, base + "slurm/job7/step0/memory.current", "1500000000\n")
    write(root, base + "slurm/job7/step0/memory.stat", "inactive_file 500000000\n")
    sampler = Sampler(proc_root=proc, etc_root=root, apple_silicon=False)
    daemon = sampler.sample().cgroup
    assert (daemon.path, daemon.limit_bytes) == ("/system.slice/memd.service", None)
    job = sampler.job(42)
    assert job.alive and job.errors == ()
    assert (job.cgroup.path, job.cgroup.limit_bytes) == ("/slurm/job7/step0", 2 * 2 ** 30)
    assert job.cgroup.working_set_bytes == 1000000000
    # The trainer's own RSS comes from statm, read right beside the cgroup's usage.
    assert job.trainer_rss_bytes == 420 * os.sysconf("SC_PAGE_SIZE")


def test_a_real_jobs_rss_is_read_with_its_cgroup():
    """A process holding 200 MB: the job read gives its resident set beside its cgroup."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(200 * 2 ** 20)\n"
                              "for i in range(0, len(b), 4096): b[i] = 1\nprint('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        job = Sampler(apple_silicon=False).job(child.pid)
        assert 200 * 2 ** 20 <= job.trainer_rss_bytes <= 260 * 2 ** 20
        assert abs(job.trainer_rss_bytes - procs.read_rss(child.pid)) < 2 ** 20
    finally:
        child.kill()
        child.wait()


def test_a_jobs_cpus_are_its_affinity_within_its_cgroup_quota(tmp_path):
    """Four CPUs allowed, a Slurm step's quota of 2.5 (its parent's 3 binds less): 2.5 usable."""
    root = str(tmp_path)
    proc = os.path.join(root, "proc")
    write(root, "proc/meminfo", "MemTotal: 8000000 kB\nMemAvailable: 6000000 kB\n")
    write(root, "proc/self/mountinfo", V1_MOUNTINFO.format(root=root) +
          "36 31 0:33 / {root}/sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n".format(root=root))
    fixture_process(proc, 42, 1, "trainer", rollup="Rss: 3000 kB\n")
    write(root, "proc/42/cgroup", "5:cpu:/slurm/step0\n4:memory:/slurm/step0\n")
    write(root, "proc/42/status", "Name:\ttrainer\nCpus_allowed_list:\t0-2,5\n")
    write(root, "sys/fs/cgroup/cpu/slurm/cpu.cfs_quota_us", "300000\n")
    write(root, "sys/fs/cgroup/cpu/slurm/cpu.cfs_period_us", "100000\n")
    write(root, "sys/fs/cgroup/cpu/slurm/step0/cpu.cfs_quota_us", "250000\n")
    write(root, "sys/fs/cgroup/cpu/slurm/step0/cpu.cfs_period_us", "100000\n")
    write(root, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n")
    write(root, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    write(root, "sys/fs/cgroup/memory/slurm/step0/memory.usage_in_bytes", "1000\n")
    write(root, "sys/fs/cgroup/memory/slurm/step0/memory.stat", "hierarchical_memory_limit 2000000000\n")
    job = Sampler(proc_root=proc, etc_root=root, apple_silicon=False).job(42)
    assert job.cpus == 2.5
    write(root, "sys/fs/cgroup/cpu/slurm/step0/cpu.cfs_quota_us", "-1\n")
    write(root, "sys/fs/cgroup/cpu/slurm/cpu.cfs_quota_us", "-1\n")
    assert Sampler(proc_root=proc, etc_root=root, apple_silicon=False).job(42).cpus == 4  # affinity alone


def test_a_v2_cpu_max_binds_its_children(tmp_path):
    """cgroup v2: the tightest cpu.max along the path ("max" is unlimited, the root has none)."""
    root = str(tmp_path)
    base = mount_cgroup(root, 2, "0::/kubepods/pod1\n")
    write(root, base + "kubepods/cpu.max", "150000 100000\n")
    write(root, base + "kubepods/pod1/cpu.max", "max 100000\n")
    assert cgroup.read_cpu_limit(proc_root=os.path.join(root, "proc")) == 1.5
    write(root, base + "kubepods/cpu.max", "max 100000\n")
    assert cgroup.read_cpu_limit(proc_root=os.path.join(root, "proc")) is None


def test_a_groups_refaults_and_major_faults_are_read_in_both_versions(tmp_path):
    """What tells a group thrashing where it has no PSI (policy.pressure.thrashing): v1's
    hierarchical counters (this machine's kernel, 6.18, writes total_workingset_refault_file and
    total_pgmajfault), v2's own; a kernel before 5.9 counts every refault together."""
    def counters(root, stat_path, stat):
        write(root, stat_path, stat)
        cg = cgroup.read_cgroup(proc_root=root + "/proc")
        return cg.refault_bytes, cg.major_faults

    v1 = str(tmp_path)
    d = mount_cgroup(v1, 1, "4:memory:/job\n") + "job/"
    write(v1, d + "memory.usage_in_bytes", "600000000\n")
    assert counters(v1, d + "memory.stat", "hierarchical_memory_limit 1073741824\nworkingset_refault_file 3\n"
                    "pgmajfault 1\ntotal_workingset_refault_file 5690\ntotal_pgmajfault 40\n") == (
        5690 * cgroup.PAGE_SIZE, 40)
    assert counters(v1, d + "memory.stat", "hierarchical_memory_limit 1073741824\nworkingset_refault 7\n") == (
        7 * cgroup.PAGE_SIZE, None)

    v2 = str(tmp_path / "v2")
    base = mount_cgroup(v2, 2, "0::/job\n")
    write(v2, base + "cgroup.controllers", "memory\n")
    write(v2, base + "job/memory.max", "max\n")
    assert counters(v2, base + "job/memory.stat", "anon 5\nworkingset_refault_anon 2\nworkingset_refault_file 9\n"
                    "pgmajfault 12\n") == (9 * cgroup.PAGE_SIZE, 12)
    assert counters(v2, base + "job/memory.stat", "anon 5\n") == (None, None)  # unknown, never 0

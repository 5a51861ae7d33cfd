"""Sampling against fixture /proc and cgroup trees, and against real processes and cgroups."""
import json
import signal
import os
import subprocess
import sys
import time
import uuid

import pytest

from memd.sampling import cgroup, procs, system
from memd.sampling.sampler import Sampler
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


def test_cgroup_v1_limit_usage_and_working_set(tmp_path):
    root = str(tmp_path)
    write(root, "proc/self/mountinfo", V1_MOUNTINFO.format(root=root))
    write(root, "proc/self/cgroup", "4:memory:/slurm/job42\n0::/\n")
    d = "sys/fs/cgroup/memory/slurm/job42/"
    write(root, d + "memory.limit_in_bytes", "1073741824\n")
    write(root, d + "memory.usage_in_bytes", "600000000\n")
    write(root, d + "memory.stat", "hierarchical_memory_limit 1073741824\ntotal_inactive_file 100000000\n")
    write(root, d + "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    cg = cgroup.read_cgroup(proc_root=root + "/proc")
    assert (cg.version, cg.path, cg.limit_bytes, cg.usage_bytes) == (1, "/slurm/job42", 1073741824, 600000000)
    assert cg.working_set_bytes == 500000000 and cg.oom_kill_events == 2


def test_cgroup_v1_unlimited_is_none(tmp_path):
    root = str(tmp_path)
    write(root, "proc/self/mountinfo", V1_MOUNTINFO.format(root=root))
    write(root, "proc/self/cgroup", "4:memory:/\n")
    d = "sys/fs/cgroup/memory/"
    write(root, d + "memory.stat", "hierarchical_memory_limit 9223372036854771712\ntotal_inactive_file 0\n")
    write(root, d + "memory.usage_in_bytes", "5\n")
    assert cgroup.read_cgroup(proc_root=root + "/proc").limit_bytes is None


def test_cgroup_v2_parent_limit_binds_and_events_pressure(tmp_path):
    root = str(tmp_path)
    write(root, "proc/self/mountinfo", V2_MOUNTINFO.format(root=root))
    write(root, "proc/1234/cgroup", "0::/kubepods/pod1/ctr\n")
    base = "sys/fs/cgroup/"
    write(root, base + "cgroup.controllers", "cpu memory pids\n")
    write(root, base + "kubepods/pod1/memory.max", "1073741824\n")
    write(root, base + "kubepods/pod1/memory.high", "max\n")
    write(root, base + "kubepods/pod1/ctr/memory.max", "max\n")
    write(root, base + "kubepods/pod1/ctr/memory.high", "900000000\n")
    write(root, base + "kubepods/pod1/ctr/memory.current", "700000000\n")
    write(root, base + "kubepods/pod1/ctr/memory.stat", "anon 500000000\ninactive_file 150000000\n")
    write(root, base + "kubepods/pod1/ctr/memory.events", "low 0\nhigh 4\nmax 9\noom 2\noom_kill 1\n")
    write(root, base + "kubepods/pod1/ctr/memory.pressure", PSI)
    cg = cgroup.read_cgroup(1234, proc_root=root + "/proc")
    assert (cg.version, cg.limit_bytes, cg.high_bytes) == (2, 1073741824, 900000000)
    assert (cg.usage_bytes, cg.working_set_bytes) == (700000000, 550000000)
    assert (cg.oom_events, cg.oom_kill_events) == (2, 1)
    assert cg.pressure.some_avg10 == 0.125


def test_cgroup_v2_without_memory_controller_is_none(tmp_path):
    root = str(tmp_path)
    write(root, "proc/self/mountinfo", V2_MOUNTINFO.format(root=root))
    write(root, "proc/self/cgroup", "0::/\n")
    write(root, "sys/fs/cgroup/cgroup.controllers", "cpu pids\n")
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
        pss_total = tree.total("pss_bytes")
        rss_total = tree.total("rss_bytes")
        assert pss_total < rss_total - 400 * MiB  # PSS counts the shared pages once, RSS four times
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        parent.wait()


def test_vanished_process_is_a_partial_answer_not_an_exception():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    tree = procs.read_tree(proc.pid)
    assert tree.processes == () and "vanished" in tree.errors[0][1]


def test_tree_of_fixture_proc(tmp_path):
    root = str(tmp_path)
    write(root, "10/stat", "10 (trainer) S 1 10 10 0 -1 0 0 0 0 0 0 0 0 0 20 0 3 0 500 0 0\n")
    write(root, "10/smaps_rollup", "Rss: 3000 kB\nPss: 2000 kB\nPrivate_Clean: 100 kB\nPrivate_Dirty: 900 kB\n")
    write(root, "10/task/10/children", "11 12")
    write(root, "10/task/13/children", "")
    write(root, "11/stat", "11 (pt_data_worker (0)) S 10 10 10 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 600 0 0\n")
    write(root, "11/smaps_rollup", "Rss: 2500 kB\nPss: 1000 kB\nPrivate_Dirty: 200 kB\n")
    write(root, "11/task/11/children", "")
    # 12 vanished between the children read and its own read
    tree = procs.read_tree(10, proc_root=root, gpu_bytes={11: 5 * MB})
    assert [p.pid for p in tree.processes] == [10, 11]
    assert tree.processes[1].name == "pt_data_worker (0)"
    assert (tree.processes[0].rss_bytes, tree.processes[0].pss_bytes, tree.processes[0].uss_bytes) == (
        3000 * 1024, 2000 * 1024, 1000 * 1024)
    assert tree.processes[1].gpu_bytes == 5 * MB
    assert tree.errors == (("procs", "process 12 vanished during the scan"),)
    assert procs.process_start_time(10, root) == 500


def test_memd_sample_pid_reports_the_tree_with_gpu_field():
    parent = subprocess.Popen([sys.executable, "-c", "import os, time; os.fork(); time.sleep(30)"],
                              start_new_session=True)
    try:
        time.sleep(0.3)
        data = json.loads(run_memd(["sample", "--json", "--pid", str(parent.pid)]).stdout)
        assert len(data["processes"]) == 2
        assert set(data["processes"][0]) == {"pid", "ppid", "name", "rss_bytes", "pss_bytes", "uss_bytes", "gpu_bytes"}
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()

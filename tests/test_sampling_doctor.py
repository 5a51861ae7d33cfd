"""`memd doctor`'s checks (memd/sampling/capabilities.py) over fixture /proc trees and the fake
NVML driver: the same platform rule as the daemon, and a bounded /proc scan."""
import os

import pytest

from memd.sampling import capabilities
from memd.sampling.nvml import Nvml

GiB = 2 ** 30


def test_doctor_classifies_gpus_with_the_host_size_as_the_daemon_does(fake_nvml_inprocess, tmp_path):
    """A GB10 whose driver answers the memory query is unified only given the host's RAM; the
    daemon passes it, so doctor must too."""
    fake_nvml_inprocess.write("gpu GPU-gb10 total=62GiB used=5GiB name=NVIDIA GB10\n")
    with open(tmp_path / "meminfo", "w") as f:
        f.write("MemTotal: %d kB\nMemAvailable: %d kB\n" % (64 * GiB // 1024, 32 * GiB // 1024))
    assert capabilities.host_total_bytes(str(tmp_path)) == 64 * GiB
    nvml = Nvml()
    try:
        found = {c.name: c for c in capabilities.check_all(nvml=nvml, proc_root=str(tmp_path), etc_root=str(tmp_path))}
    finally:
        nvml.shutdown()
    assert found["nvml"].available
    assert "1 GPU," in found["nvml"].detail and "1 with unified memory" in found["nvml"].detail


def other_users_process(root, pid):
    """A /proc entry owned by someone else: chowned when we are root, else root's init."""
    path = os.path.join(root, str(pid))
    if os.geteuid() == 0:
        os.mkdir(path)
        with open(os.path.join(path, "smaps_rollup"), "w") as f:
            f.write("Rss: 4 kB\n")
        os.chown(path, 65534, 65534)
    else:
        os.symlink("/proc/1", path)


def test_proc_access_scan_is_bounded(tmp_path):
    root = str(tmp_path)
    limit = capabilities.PROC_ACCESS_PROBES
    for pid in range(1, limit + 2):  # one more than the bound: our own pid may be among them
        os.mkdir(os.path.join(root, str(pid)))
    other_users_process(root, 100000)  # sorted last, beyond the bound
    bounded = capabilities.check_proc_access(root)
    assert "pid 100000" not in bounded.detail
    if os.geteuid() != 0:
        assert bounded.available and "among the %d looked at" % limit in bounded.detail
    # the same tree with few processes: the other user's one is reached
    reached = capabilities.check_proc_access(root, limit=limit + 10)
    assert "pid 100000" in reached.detail


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a fixture entry another user's")
def test_proc_access_on_a_kernel_without_smaps_rollup(tmp_path):
    root = str(tmp_path)
    other_users_process(root, 100)
    os.remove(os.path.join(root, "100", "smaps_rollup"))
    with open(os.path.join(root, "100", "statm"), "w") as f:
        f.write("9000 100 300 1 0 500 0\n")
    found = capabilities.check_proc_access(root)
    assert not found.available and "older than 4.14" in found.detail

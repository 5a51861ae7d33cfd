"""Sessions attributed to their Kubernetes pod and Slurm job: the parsers over real-format
/proc texts, the daemon's own reads over a fixture /proc tree, and end to end a real daemon
reading a real child process's environment (which wins over what its client says)."""
import json
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from memd import attribution
from memd.client import Refused, protocol
from realdaemon import Daemon, memd_env, run_memd, wait_for

UID = "8f4b0a52-3c1e-4d7a-9b2f-0e6c5d4a3b21"


@pytest.mark.parametrize("cgroup", [
    # cgroup v1, cgroupfs driver (burstable and guaranteed QoS)
    "12:memory:/kubepods/burstable/pod%s/0123abcd\n11:cpu,cpuacct:/kubepods/burstable/pod%s/0123abcd\n" % (UID, UID),
    "4:memory:/kubepods/pod%s/0123abcd\n" % UID,
    # cgroup v2, systemd driver: dashes become underscores in the slice name
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod%s.slice/cri-containerd-ab12.scope\n"
    % UID.replace("-", "_"),
    # as memd in its own pod sees another pod's process: relative to its cgroup namespace
    "0::/../../kubepods-besteffort-pod%s.slice/cri-containerd-ab12.scope\n" % UID.replace("-", "_"),
])
def test_pod_uid_from_kubelet_cgroup_paths(cgroup):
    assert protocol.pod_uid_in(cgroup) == UID


def test_no_pod_outside_kubernetes():
    assert protocol.pod_uid_in("0::/user.slice/user-1000.slice/session-3.scope\n") is None
    assert protocol.pod_uid_in("0::/system.slice/docker-%s.scope\n" % ("a" * 64)) is None


@pytest.mark.parametrize("cgroup,job", [
    ("7:memory:/slurm/uid_1000/job_4242/step_0/task_1\n", "4242"),  # v1
    ("0::/system.slice/slurmstepd.scope/job_4242/step_batch/user/task_0\n", "4242"),  # v2
    ("0::/user.slice/job_4242/x\n", None),  # not slurmstepd's
])
def test_slurm_job_from_cgroup_paths(cgroup, job):
    assert attribution.slurm_job_in_cgroup(cgroup) == job


def fixture_proc(tmp_path, pid, cgroup, environ=None):
    base = tmp_path / str(pid)
    base.mkdir(parents=True)
    (base / "cgroup").write_text(cgroup)
    if environ is not None:
        (base / "environ").write_bytes(environ)
    return str(tmp_path)


def test_read_prefers_the_cgroup_then_the_environment(tmp_path):
    root = fixture_proc(tmp_path, 10, "0::/kubepods/pod%s/c\n" % UID, b"SLURM_JOB_ID=1\0")
    assert attribution.read(10, root) == attribution.Attribution(UID, None, "cgroup")
    root = fixture_proc(tmp_path, 11, "0::/user.slice/x\n", b"HOME=/root\0SLURM_JOB_ID=77\0SLURM_JOB_IDX=9\0")
    assert attribution.read(11, root) == attribution.Attribution(None, "77", "environ")
    root = fixture_proc(tmp_path, 12, "0::/user.slice/x\n", b"XSLURM_JOB_ID=5\0")
    assert attribution.read(12, root) == attribution.Attribution()  # read: in neither
    assert attribution.read(13, root) is None  # gone (or unreadable): unknown, the client's word stands


CHILD = textwrap.dedent("""
    import os, sys
    from memd.client import Session
    os.environ["SLURM_JOB_ID"] = "999"  # what the client says now; /proc/PID/environ keeps 4242
    with Session(job="slurm-job", endpoint=sys.argv[1], timeout=2.0) as s:
        s.plan()
        print("open", flush=True)
        sys.stdin.readline()
""")


def test_daemon_reads_the_job_environment_and_labels_its_metrics(tmp_path):
    daemon = Daemon(tmp_path, metrics=True).start()
    child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.endpoint], env=memd_env({"SLURM_JOB_ID": "4242"}),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "open"
        # a job on another host: what its client says, marked as such
        remote = daemon.call("hello", job="far-job", pid=5, host="elsewhere", min_batch=1, pod_uid=UID)
        assert remote["token"]
        with pytest.raises(Refused, match="pod_uid"):
            daemon.call("hello", job="bad", pid=6, host="elsewhere", min_batch=1, pod_uid="../../etc")
        sessions = {s["job"]: s for s in daemon.call("status")["sessions"]}
        here, far = sessions["slurm-job"], sessions["far-job"]
        assert (here["slurm_job_id"], here["pod_uid"], here["attributed_by"]) == ("4242", None, "environ")
        assert (far["slurm_job_id"], far["pod_uid"], far["attributed_by"]) == (None, UID, "client")
        human = run_memd(["status", "--endpoint", daemon.endpoint])
        assert "in Slurm job 4242 (read from its environment)" in human.stdout
        assert "in Kubernetes pod %s (as its client said; not checked)" % UID in human.stdout
        assert json.loads(run_memd(["status", "--json", "--endpoint", daemon.endpoint]).stdout)["sessions"]
        url = "http://%s/metrics" % daemon.metrics_address
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        batch = [line for line in text.splitlines() if line.startswith("memd_session_recommended_batch_size{")]
        assert any('slurm_job_id="4242"' in line and 'pod_uid=""' in line for line in batch), batch
        assert any('pod_uid="%s"' % UID in line for line in batch), batch
    finally:
        child.stdin.close()
        child.wait(10)
        assert daemon.stop() == 0
    assert wait_for(lambda: '"slurm_job_id": "4242"' in daemon.log())  # session_opened names it


def test_client_says_its_pod_and_slurm_job(tmp_path):
    from memd.client.identity import scheduler_identity as _scheduler_identity

    me = tmp_path / "self"
    me.mkdir()
    (me / "cgroup").write_text("0::/\n")  # a private cgroup namespace hides the kubepods path
    (me / "mountinfo").write_text(
        "1401 1380 0:33 /var/lib/kubelet/pods/%s/volumes/x /var/run/secrets ro - tmpfs tmpfs rw\n"
        "1402 1380 259:1 /var/lib/kubelet/pods/%s/etc-hosts /etc/hosts rw - ext4 /dev/nvme0n1p1 rw\n"
        % ("0" * 8 + "-0000-0000-0000-" + "0" * 12, UID))
    assert _scheduler_identity(str(tmp_path), {"SLURM_JOB_ID": "17"}) == {"pod_uid": UID, "slurm_job_id": "17"}
    (me / "mountinfo").write_text("22 1 259:1 / / rw - ext4 /dev/nvme0n1p1 rw\n")
    assert _scheduler_identity(str(tmp_path), {"SLURM_JOB_ID": "17; rm"}) == {}  # not a job id: not sent
    (me / "cgroup").write_text("12:memory:/kubepods/burstable/pod%s/c\n" % UID)
    assert _scheduler_identity(str(tmp_path), {}) == {"pod_uid": UID}


def test_what_the_daemon_reads_overrides_what_the_client_says(tmp_path):
    from memd import ops
    from memd.config import Config
    from memd.core import Core
    from memd.sampling.snapshot import CPU, Snapshot, SystemMemory
    from memd.sessions import Sessions
    from memd.state import StateStore

    root = fixture_proc(tmp_path / "proc", 321, "0::/user.slice/x\n", b"HOME=/home/a\0")
    core = Core(config=Config(), sessions=Sessions(8, 60.0, time.monotonic, lambda s: True),
                store=StateStore(str(tmp_path / "state")), host="here", proc_root=root)
    core.snapshot = Snapshot(taken_at=0.0, monotonic=0.0, host="here", memory_model=CPU,
                             system=SystemMemory(64 << 30, 32 << 30, 0, 0, 0), pressure=None, cgroup=None)
    claim = dict(min_batch=1, slurm_job_id="5", pod_uid=UID)
    local = core.sessions.get(ops.hello(core, dict(claim, job="a", pid=321, host="here"))["token"])
    assert local.local and (local.pod_uid, local.slurm_job_id, local.attributed_by) == (None, None, None)
    remote = core.sessions.get(ops.hello(core, dict(claim, job="b", pid=321, host="there"))["token"])
    assert (remote.pod_uid, remote.slurm_job_id, remote.attributed_by) == (UID, "5", "client")

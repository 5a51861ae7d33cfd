"""A hello's pid claim (issue 11): the daemon watches the pid only when the client's pid
namespace and start time, where it sends them, match what the daemon reads; a job on this host
that fails them is not measured and its plan says why. Over a fixture /proc, no daemon."""
import os
from types import SimpleNamespace

import pytest

from memd import ops
from memd.client import protocol
from memd.client.identity import process_identity
from memd.config import Config
from memd.core import Core
from memd.ops import watch
from memd.sampling import procs
from memd.sampling.snapshot import CPU, Snapshot, SystemMemory
from memd.sessions import Sessions
from memd.state import StateStore

GB = 10 ** 9
PID = 4242
START = 777


def write(root, rel, text):
    path = os.path.join(str(root), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def fixture_proc(root, own_ns=True):
    """A /proc where PID started at tick START with a peak of 2 GB; the daemon's own pid
    namespace is a file whose inode stands for it (returned: None when there is none)."""
    write(root, "proc/%d/stat" % PID, "%d (py thon) S " % PID + " ".join(["0"] * 18) + " %d 0\n" % START)
    write(root, "proc/%d/status" % PID, "Name:\tpython\nVmHWM:\t%d kB\n" % (2 * GB // 1024))
    ns = os.stat(write(root, "proc/self/ns/pid", "")).st_ino if own_ns else None
    return str(root / "proc"), ns


def test_the_fixture_reads_as_the_daemon_reads_proc(tmp_path):
    root, ns = fixture_proc(tmp_path)
    assert procs.process_start_time(PID, root) == START and procs.pid_namespace("self", root) == ns


def test_a_pid_is_local_only_when_what_the_client_sends_matches(tmp_path):
    root, ns = fixture_proc(tmp_path)
    core = SimpleNamespace(host="here", proc_root=root)
    assert watch.watchable(core, "here", PID, None, None) == (True, None)  # an older client: as before
    assert watch.watchable(core, "here", PID, ns, START) == (True, None)
    assert watch.watchable(core, "here", PID, ns, None) == (True, None)
    assert watch.watchable(core, "here", PID, None, START) == (True, None)
    assert watch.watchable(core, "there", PID, ns + 1, START + 1) == (False, None)  # another host: nothing to say
    assert watch.watchable(core, "here", PID + 1, None, None) == (False, None)  # no such process here
    local, why = watch.watchable(core, "here", PID, ns + 1, START)
    assert not local and why == "pid %d here is another process (this job is in another pid namespace)" % PID
    local, why = watch.watchable(core, "here", PID + 1, ns + 1, None)
    assert not local and why == "this job is in another pid namespace"
    local, why = watch.watchable(core, "here", PID, ns, START + 1)
    assert not local and why == "pid %d here is another process (it started at another time than this job)" % PID


def test_a_namespace_the_daemon_cannot_check_is_not_trusted(tmp_path):
    """Its own /proc/self/ns/pid unreadable, the daemon cannot tell a stranger from the job: it
    does not measure it (the start time alone would let a pid 1 started at the same tick pass)."""
    root, _ = fixture_proc(tmp_path, own_ns=False)
    core = SimpleNamespace(host="here", proc_root=root)
    local, why = watch.watchable(core, "here", PID, 12345, START)
    assert not local and "cannot read its own pid namespace" in why
    assert watch.watchable(core, "here", PID, None, START) == (True, None)  # no namespace claimed: nothing to check


def host_core(tmp_path):
    root, ns = fixture_proc(tmp_path)
    core = Core(config=Config(), sessions=Sessions(8, 60.0, lambda: 0.0, lambda s: True),
                store=StateStore(str(tmp_path / "state")), clock=lambda: 0.0, proc_root=root, host="here")
    core.snapshot = Snapshot(taken_at=0.0, monotonic=0.0, host="here", memory_model=CPU,
                             system=SystemMemory(64 * GB, 60 * GB, 4 * GB, 0, 0), pressure=None, cgroup=None)
    return core, ns


def test_a_job_whose_pid_claim_fails_is_not_measured_and_its_plan_says_why(tmp_path):
    core, ns = host_core(tmp_path)
    clear_refs = os.path.join(core.proc_root, str(PID), "clear_refs")
    stranger = ops.hello(core, dict(job="in-a-container", pid=PID, host="here", pid_ns=ns + 1, start_time=START))
    reason = stranger["plan"]["reason"]
    assert reason.endswith("; pid %d here is another process (this job is in another pid namespace): planned from "
                           "its reports" % PID), reason
    reply = ops.report(core, {"token": stranger["token"], "batch_size": 8})  # no peak: the daemon would measure
    assert "another pid namespace" in reply["plan"]["reason"]
    view = ops.status(core, {})["sessions"][0]
    assert view["unwatched"].startswith("pid %d here is another process" % PID)
    assert view["latest_peak_bytes"] is None and not os.path.exists(clear_refs)  # neither read nor reset
    # The same pid claimed with the daemon's own namespace and the pid's start: measured and reset.
    watched = ops.hello(core, dict(job="on-the-host", pid=PID, host="here", pid_ns=ns, start_time=START))
    assert "planned from its reports" not in watched["plan"]["reason"]
    ops.report(core, {"token": watched["token"], "batch_size": 8})
    view = next(v for v in ops.status(core, {})["sessions"] if v["job"] == "on-the-host")
    assert view["unwatched"] is None and view["latest_peak_bytes"] == 2 * GB // 1024 * 1024
    assert open(clear_refs).read() == "5"


@pytest.mark.parametrize("field, value", [("pid_ns", 0), ("pid_ns", -1), ("start_time", -1), ("pid_ns", "1")])
def test_claims_out_of_range_are_refused(tmp_path, field, value):
    core, _ = host_core(tmp_path)
    with pytest.raises(ops.Invalid, match="^%s" % field):
        ops.hello(core, {"job": "j", "pid": PID, "host": "here", field: value})


def test_the_client_sends_its_namespace_and_start_time_when_it_can_read_them(tmp_path):
    root = tmp_path / "proc"
    ns = os.stat(write(tmp_path, "proc/self/ns/pid", "")).st_ino
    write(tmp_path, "proc/self/stat", "%d (a) b) R " % PID + " ".join(["0"] * 18) + " %d 0\n" % START)
    assert process_identity(str(root)) == {"pid_ns": ns, "start_time": START}
    write(tmp_path, "proc/self/stat", "%d (a) R 1\n" % PID)  # too short: left out
    assert process_identity(str(root)) == {"pid_ns": ns}
    write(tmp_path, "proc/self/stat", "%d (a) R " % PID + " ".join(["0"] * 18) + " %d 0\n" % 2 ** 64)
    assert process_identity(str(root)) == {"pid_ns": ns}  # beyond its range: a hello must not be refused
    assert process_identity(str(tmp_path / "nowhere")) == {}  # not Linux


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="no /proc/self/ns/pid here (not Linux)")
def test_the_client_reads_what_the_daemon_reads_of_it():
    assert process_identity() == {"pid_ns": procs.pid_namespace(os.getpid()),
                                   "start_time": procs.process_start_time(os.getpid())}
    assert set(process_identity()) <= set(protocol.FIELD_RANGES)

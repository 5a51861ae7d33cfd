"""A pid claim the daemon can check (issue 11), against the real daemon: a real client in a pid
namespace of its own (as in a container sharing the host's name) names a pid that in the daemon's
view is an unrelated process, and raw hellos claim a process of the test's whose peak (VmHWM) the
test can watch: the daemon measures and resets it only when the claim holds."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from memd.sampling import procs
from realdaemon import memd_env, wait_for

HOST = socket.gethostname()

# A job in a pid namespace of its own: its first plan, a report without a peak (the daemon would
# measure it), then its session as status shows it once the report is in; bye on close.
JOB = r"""
import json, os, sys, time
from memd import client
endpoint = sys.argv[1]
s = client.Session("pid-claim", endpoint=endpoint, timeout=2.0)
s.plan()
s.report(batch_size=8)
deadline = time.monotonic() + 10
mine = []
while time.monotonic() < deadline:
    mine = [v for v in client.call("status", endpoint=endpoint)["sessions"] if v["job"] == "pid-claim"]
    if mine and mine[0]["reports"] == 1:
        break
    time.sleep(0.02)
s.close()
print(json.dumps({"pid": os.getpid(), "session": mine[0] if mine else None}))
"""


def unshare_refused():
    """Why a pid namespace cannot be made here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True,
                          timeout=10)
    return None if done.returncode == 0 else "unshare --pid --fork --mount-proc is not permitted: %s" % (
        done.stderr.strip() or done.returncode)


def run_job(memd, *prefix):
    done = subprocess.run(list(prefix) + [sys.executable, "-c", JOB, memd.endpoint], env=memd_env(),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_client_in_another_pid_namespace_is_watched_as_its_process_here(memd):
    """A job in a container names itself by its pid there (1 here); over the ipc socket the kernel
    gives the daemon that process's pid in its own namespace, and the daemon watches that one."""
    refused = unshare_refused()
    if refused:
        pytest.skip(refused)
    inside = run_job(memd, "unshare", "--pid", "--fork", "--mount-proc")
    assert inside["pid"] == 1, inside  # in the daemon's view pid 1 is this machine's (or container's) init
    view = inside["session"]
    assert view["pid"] != 1 and view["unwatched"] is None, view
    assert "planned from its reports" not in view["plan"]["reason"], view
    if memd.call("status")["snapshot"]["memory_model"] != "discrete":
        assert view["latest_peak_bytes"], view  # its report without a peak was measured, on its process here
    # The same job on the host is watched as ever.
    outside = run_job(memd)
    view = outside["session"]
    assert view["pid"] == outside["pid"] and view["unwatched"] is None, view


def test_over_loopback_tcp_a_client_in_another_pid_namespace_is_watched_as_its_process_here(start_memd):
    """TCP carries no credentials, but the kernel names the process holding a loopback
    connection's other end (memd.loopback): as over ipc, the job is watched as its pid here.
    Before, it could not be told from pid 1 here and was planned from its reports."""
    from realdaemon import free_port
    refused = unshare_refused()
    if refused:
        pytest.skip(refused)
    memd = start_memd(endpoint="tcp://127.0.0.1:%d" % free_port())
    inside = run_job(memd, "unshare", "--pid", "--fork", "--mount-proc")
    view = inside["session"]
    assert inside["pid"] == 1 and view["pid"] != 1 and view["unwatched"] is None, inside
    assert "planned from its reports" not in view["plan"]["reason"], view


@pytest.fixture
def hoarder():
    """A process of the test's whose peak is well above what it holds: 64 MiB touched, freed."""
    code = "import sys; b = b'x' * (64 << 20); del b; print('ready', flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    yield proc
    proc.stdin.close()
    proc.wait(10)


def peak_and_rss(pid):
    with open("/proc/%d/status" % pid) as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


def file_pages(pid):
    """What the process maps from files (RssFile): the daemon's measured peak leaves it out."""
    with open("/proc/%d/status" % pid) as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def claim(memd, pid, **identity):
    """A raw hello for ``pid`` on this host and a report without a peak; its session's view."""
    wait_for(lambda: memd.call("status")["snapshot"])  # hello needs the daemon's first sample
    job = "claim-%d-%s" % (pid, "-".join(sorted(identity)))
    token = memd.call("hello", job=job, pid=pid, host=HOST, **identity)["token"]
    memd.call("report", token=token, batch_size=8)  # the reply comes after the daemon handled it
    view = next(v for v in memd.call("status")["sessions"] if v["job"] == job)
    memd.call("bye", token=token)
    return view


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="no pid namespaces here (not Linux)")
def test_a_raw_hello_with_a_wrong_claim_leaves_the_process_alone(memd, hoarder):
    ns, start = procs.pid_namespace(), procs.process_start_time(hoarder.pid)
    peak, rss = peak_and_rss(hoarder.pid)
    assert peak > rss + 32 * 2 ** 20, (peak, rss)  # a reset would show
    view = claim(memd, hoarder.pid, pid_ns=ns + 1, start_time=start)
    assert "another pid namespace" in view["unwatched"] and view["latest_peak_bytes"] is None, view
    view = claim(memd, hoarder.pid, pid_ns=ns, start_time=start + 1)
    assert "started at another time" in view["unwatched"] and view["latest_peak_bytes"] is None, view
    assert peak_and_rss(hoarder.pid)[0] == peak  # neither claim reset its peak
    if memd.call("status")["snapshot"]["memory_model"] == "discrete":
        return  # its pool would be a GPU, measured through NVML: no peak of its own to reset
    view = claim(memd, hoarder.pid, pid_ns=ns, start_time=start)  # the claim holds: measured and reset
    assert view["unwatched"] is None and view["latest_peak_bytes"] == peak - file_pages(hoarder.pid), view
    assert peak_and_rss(hoarder.pid)[0] < peak - 32 * 2 ** 20

"""A job in a real memory cgroup smaller than the host, against the real daemon: what it learned
is saved under the pool its hello looked it up in, so its next run, on the same daemon or after
a restart, starts from its curve within its cgroup."""
import json
import signal
import subprocess
import sys
import uuid

import pytest

from bench import memcg
from memd.policy.controller import FIRST_BATCH
from realdaemon import memd_env

pytestmark = pytest.mark.skipif(memcg.available() is not None, reason="needs a writable memory cgroup (root): %s"
                                % memcg.available())

GiB = 2 ** 30
MB = 10 ** 6

# The job: its first plan, then (to learn) a warm-up step and steps at two batch sizes, 200 MB
# + 10 MB a sample (reported: 3.2 GB at 300 as if it ran in a larger pool), waiting until the
# daemon has them all; bye on close.
JOB = r"""
import json, os, sys, time
from memd import client
endpoint, learn = sys.argv[1], sys.argv[2] == "learn"
s = client.Session("bounded", endpoint=endpoint, timeout=2.0, max_batch=100000)
first = s.plan()
out = {"batch_size": first.batch_size, "reason": first.reason, "source": first.source}
if learn:
    for batch in (8, 8, 8, 300, 300):
        s.report(batch_size=batch, peak_bytes=200 * 10 ** 6 + batch * 10 ** 7)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        mine = [v for v in client.call("status", endpoint=endpoint)["sessions"] if v["pid"] == os.getpid()]
        if mine and mine[0]["reports"] == 5:
            out["pool_key"] = mine[0].get("pool_key")
            break
        time.sleep(0.05)
s.close()
print(json.dumps(out))
"""


def run_job(cg, memd, learn):
    done = subprocess.run([sys.executable, "-c", JOB, memd.endpoint, "learn" if learn else "again"],
                          env=memd_env(), capture_output=True, text=True, timeout=60, preexec_fn=cg.join)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def sessions_end(memd):
    import time
    deadline = time.monotonic() + 10
    while memd.call("status")["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not memd.call("status")["sessions"]


def test_a_job_in_a_small_cgroup_finds_its_curve_on_the_same_daemon_and_after_a_restart(memd):
    if memd.call("status")["snapshot"]["memory_model"] != "cpu":
        pytest.skip("the job's pool here is a GPU or unified memory, not its cgroup's share of host RAM")
    with memcg.MemoryCgroup(2 * GiB, name="memd-test-identity-%s" % uuid.uuid4().hex[:10]) as cg:  # removed on exit
        learned = run_job(cg, memd, learn=True)
        assert learned["batch_size"] == FIRST_BATCH and "no reports yet" in learned["reason"], learned  # a stranger
        sessions_end(memd)
        for restart in (False, True):
            if restart:
                assert memd.stop() == 0
                memd.start()
            again = run_job(cg, memd, learn=False)
            # Its first plan comes from its curve, within its 2 GiB: never memd's first batch, nor
            # the 300 it ran, nor what the host's RAM would allow (about 1,000 on this host). Its
            # earlier run made 4 reports: its first steps leave room for a rarer one (invariants.py).
            assert again["source"] == "daemon", (restart, again)
            assert ("from earlier runs of this job" in again["reason"]
                    or "in case a rarer step peaks higher (4 so far" in again["reason"]), (restart, again)
            assert 8 < again["batch_size"] < (2 * GiB - 200 * MB) / (10 * MB), (restart, again)
            sessions_end(memd)
    # its cgroup's 2 GiB, not the host's RAM; then its configuration (max_batch)
    assert learned["pool_key"].startswith("cpu:2#"), learned
    curves = json.loads((memd.tmp_path / "state" / "curves.json").read_text())
    assert list(curves["jobs"]) == ["bounded|" + learned["pool_key"]]


# A job that holds most of its cgroup (1.2 GiB of 2), learns at batches 60 and 100 (its peaks
# 200 MB + 10 MB a sample, as reported), says which batch it runs, then waits; after the daemon
# is killed and started again, it asks for its plan (its token unknown now: hello again).
RUNNING = r"""
import json, sys, time
from memd import client
held = bytearray(1200 * 2 ** 20)
held[::4096] = b"x" * len(held[::4096])
s = client.Session("running", endpoint=sys.argv[1], timeout=2.0, max_batch=100000, default_batch=60)
s.plan()
for batch in (60, 60, 60, 100, 100, 100):
    s.report(batch_size=batch, peak_bytes=200 * 10 ** 6 + batch * 10 ** 7)
    time.sleep(0.3)  # samples come between the steps
s._plan_expires = 0
runs = s.plan()
print(json.dumps({"batch_size": runs.batch_size, "reason": runs.reason}), flush=True)
sys.stdin.readline()  # the daemon is killed and started again meanwhile
time.sleep(2.5)  # a flush interval's worth: the plan the job holds goes stale
s._plan_expires = 0
again = s.plan()
print(json.dumps({"batch_size": again.batch_size, "reason": again.reason, "source": again.source}), flush=True)
s.close()
"""


def test_a_running_job_is_not_cut_when_the_daemon_restarts_under_it(start_memd):
    """Said hello again with nothing reported yet, a running job's own memory was counted as
    someone else's: in a cgroup it mostly fills, its next plan fell to a handful of samples
    where it ran 100. It says which batch it runs, and holds it until its memory is read."""
    memd = start_memd(env={"MEMD_FLUSH_INTERVAL": "0.2"})
    if memd.call("status")["snapshot"]["memory_model"] != "cpu":
        pytest.skip("the job's pool here is a GPU or unified memory, not its cgroup's share of host RAM")
    with memcg.MemoryCgroup(2 * GiB, name="memd-test-running-%s" % uuid.uuid4().hex[:10]) as cg:  # removed on exit
        job = subprocess.Popen([sys.executable, "-c", RUNNING, memd.endpoint], env=memd_env(), stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=cg.join)
        try:
            before = json.loads(job.stdout.readline())
            assert before["batch_size"] >= 100, before  # it learned room for more than it ran
            memd.stop(signal.SIGKILL)
            memd.start()
            job.stdin.write("go\n")
            job.stdin.flush()
            after = json.loads(job.stdout.readline())
        finally:
            job.kill()
            job.wait()
    assert after["source"] == "daemon" and after["batch_size"] >= before["batch_size"], (before, after)

"""`memd curves` and `memd forget` against the real daemon: what a job taught it is shown,
forgotten for good (a restart, even a kill, does not bring it back), and not written back by a
session that was open when it was forgotten."""
import json
import os
import signal
import time

import msgpack
import pytest
import zmq

from memd import client
from memd.client import protocol
from realdaemon import raw_socket, run_memd, wait_for

GB = 10 ** 9


def curves(memd):
    out = run_memd(["curves", "--json", "--endpoint", memd.endpoint])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def forget(memd, *args):
    return run_memd(["forget", *args, "--endpoint", memd.endpoint])


def reports(memd, job):
    return sum(s["reports"] for s in memd.call("status")["sessions"] if s["job"] == job)


def teach(memd, job, peaks=(GB + 4 * 10 ** 8, GB + 4 * 10 ** 8, GB + 8 * 10 ** 8), oom=None):
    """A run of ``job``: steps at batch 4, 4 (the first a warm-up), 8, then an OOM, then bye."""
    with client.Session(job, endpoint=memd.endpoint, timeout=1.0, default_batch=32) as s:
        s.plan()
        for batch, peak in zip((4, 4, 8), peaks):
            s.report(batch_size=batch, peak_bytes=peak)
        assert wait_for(lambda: reports(memd, job) == 3)
        if oom is not None:
            s.report_oom(batch_size=oom)
    assert wait_for(lambda: not any(v["job"] == job for v in memd.call("status")["sessions"]))


def first_plan(memd, job):
    with client.Session(job, endpoint=memd.endpoint, timeout=1.0, default_batch=32) as s:
        return s.plan()


def test_curves_shows_what_a_job_taught_and_forget_starts_it_fresh_for_good(memd):
    started = time.time()
    teach(memd, "taught", oom=32)
    [entry] = curves(memd)
    assert entry["job"] == "taught" and entry["pool"]
    assert entry["points"] == [[4, GB + 4 * 10 ** 8], [8, GB + 8 * 10 ** 8]]  # never the warm-up step
    assert entry["ceiling"] == 31
    assert int(started) <= entry["updated"] <= time.time()
    human = run_memd(["curves", "--endpoint", memd.endpoint])
    assert human.returncode == 0, human.stderr
    assert "taught" in human.stdout and entry["pool"] in human.stdout and "at batch 4: 1.30, 8: 1.68" in human.stdout
    assert all(len(line) <= 80 for line in human.stdout.splitlines())

    with client.Session("taught", endpoint=memd.endpoint, timeout=1.0, default_batch=32) as live:
        # What it learned decides: below the batch that failed, and where an overshoot kills, no more
        # than twice the largest it ran (8).
        assert live.plan().batch_size == 16
        out = forget(memd, "taught")
        assert out.returncode == 0, out.stderr
        assert out.stdout == "forgot 1 curve of job taught; 1 live session of it will keep nothing learned before now\n"
        assert curves(memd) == []
    # The live session started with the forgotten ceiling: its bye must not write it back.
    assert wait_for(lambda: not memd.call("status")["sessions"])
    assert curves(memd) == []
    plan = first_plan(memd, "taught")
    assert plan.batch_size == 32 and "ceiling" not in plan.reason, plan  # the default, not what was learned

    assert memd.stop() == 0
    memd.start()
    assert curves(memd) == []
    assert first_plan(memd, "taught").batch_size == 32


def test_a_forget_is_on_disk_at_once(memd):
    teach(memd, "durable", oom=32)
    assert memd.stop() == 0  # written at shutdown: the next daemon reads it back
    memd.start()
    assert [c["job"] for c in curves(memd)] == ["durable"]
    assert forget(memd, "durable").returncode == 0
    memd.stop(signal.SIGKILL)  # no shutdown flush: only what forget wrote itself
    memd.start()
    assert curves(memd) == []
    assert first_plan(memd, "durable").batch_size == 32


def test_a_live_session_keeps_only_what_it_learns_after_the_forget(start_memd):
    memd = start_memd(env={"MEMD_FLUSH_INTERVAL": "0.2"})
    s = client.Session("ongoing", endpoint=memd.endpoint, timeout=1.0, default_batch=8)
    try:
        s.plan()
        for batch in (4, 4, 8):
            s.report(batch_size=batch, peak_bytes=GB + batch * 10 ** 8)
        assert wait_for(lambda: [len(c["points"]) for c in curves(memd)] == [2])  # written while it runs
        assert forget(memd, "ongoing").returncode == 0
        time.sleep(0.6)  # flushes come and go: nothing learned before the forget is written back
        assert curves(memd) == []
        s.report(batch_size=16, peak_bytes=GB + 16 * 10 ** 8)
        assert wait_for(lambda: reports(memd, "ongoing") == 4)
        assert wait_for(lambda: curves(memd)), "what it learned after the forget is kept"
        assert [c["points"] for c in curves(memd)] == [[[16, GB + 16 * 10 ** 8]]]
    finally:
        s.close()
    assert wait_for(lambda: not memd.call("status")["sessions"])
    assert [c["points"] for c in curves(memd)] == [[[16, GB + 16 * 10 ** 8]]]


def test_forget_of_one_pool_keeps_the_others(memd):
    teach(memd, "pooled")
    [entry] = curves(memd)
    out = forget(memd, "pooled", "--pool", "gpu:Other:1")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == "memd: nothing remembered for job pooled in pool gpu:Other:1 (`memd curves` lists what is)\n"
    assert len(curves(memd)) == 1
    out = forget(memd, "pooled", "--pool", entry["pool"])
    assert out.returncode == 0 and out.stdout == "forgot 1 curve of job pooled in pool %s\n" % entry["pool"]
    assert curves(memd) == []


def test_forget_of_an_unknown_job_says_so_in_one_line(memd):
    teach(memd, "known")
    out = forget(memd, "unknown")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == ["memd: nothing remembered for job unknown (`memd curves` lists what is)"]
    assert forget(memd, "know").returncode == 1  # a job name, not a prefix
    assert [c["job"] for c in curves(memd)] == ["known"]


def test_curves_and_forget_without_a_daemon_exit_1(tmp_path):
    for args in (["curves"], ["curves", "--json"], ["forget", "job"]):
        out = run_memd(args + ["--endpoint", "ipc://%s/none.sock" % tmp_path, "--timeout", "0.2"])
        assert out.returncode == 1 and out.stdout == "", args
        assert "memd serve" in out.stderr and len(out.stderr.splitlines()) == 1


@pytest.fixture
def raw(memd):
    with raw_socket(memd.endpoint) as exchange:
        yield lambda op, **fields: exchange(protocol.encode(protocol.request(op, 7, **fields)))


MALFORMED = [
    ("forget", {}, "job"),
    ("forget", {"job": ""}, "job"),
    ("forget", {"job": "x" * 129}, "job"),
    ("forget", {"job": 5}, "job"),
    ("forget", {"job": ["taught"]}, "job"),
    ("forget", {"job": "taught", "pool": 5}, "pool"),
    ("forget", {"job": "taught", "pool": ""}, "pool"),
    ("forget", {"job": "taught", "pool": "p" * 513}, "pool"),
    ("curves", {"after": "taught"}, "after"),
    ("curves", {"after": ["taught"]}, "after"),
    ("curves", {"after": [1, 2]}, "after"),
    ("curves", {"after": ["taught", "x" * 513]}, "after"),
]


def test_malformed_curves_and_forget_requests_are_invalid_and_change_nothing(memd, raw):
    teach(memd, "taught")
    for op, fields, field in MALFORMED:
        reply = raw(op, **fields)
        assert reply["ok"] is False and reply["error"]["code"] == protocol.INVALID, (op, fields, reply)
        assert reply["error"]["message"].startswith(field + " "), (op, fields, reply)
    assert [c["job"] for c in curves(memd)] == ["taught"]
    assert raw("ping")["result"]["pong"] is True


def test_an_empty_job_name_is_refused_as_bad_input(memd):
    out = forget(memd, "")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["memd: %s refused forget: job must not be empty" % memd.endpoint]


def test_a_full_store_is_shown_whole_in_pages_that_each_fit_a_message(start_memd, tmp_path):
    """512 entries, each with a 128-character job name and 32 points: about 300 KiB, far beyond
    one message. The daemon answers page by page; the CLI shows them all."""
    jobs = {}
    for i in range(512):
        job = "job-%03d-" % i + "x" * 120
        jobs["%s|cpu:23" % job] = {"points": [[b, 2 ** 40 + b] for b in range(1, 33)], "ceiling": 2 ** 31 - 1,
                                   "updated": 1.5e9}
    state = tmp_path / "state"
    state.mkdir()
    (state / "curves.json").write_text(json.dumps({"version": 1, "jobs": jobs}))
    memd = start_memd()
    shown = curves(memd)
    assert [c["job"] for c in shown] == sorted(key.split("|")[0] for key in jobs)
    assert shown[0]["points"][-1] == [32, 2 ** 40 + 32] and shown[0]["updated"] == 1500000000

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(memd.endpoint)
    try:
        after, pages, seen = None, 0, 0
        while True:
            fields = {} if after is None else {"after": after}
            sock.send(protocol.encode(protocol.request("curves", 7, **fields)))
            assert sock.poll(2000, zmq.POLLIN)
            frame = sock.recv()
            assert len(frame) <= protocol.MAX_MESSAGE_BYTES
            result = msgpack.unpackb(frame, raw=False)["result"]
            assert result["total"] == 512
            seen += len(result["curves"])
            pages += 1
            after = result["next"]
            if after is None:
                break
    finally:
        sock.close(0)
        ctx.term()
    assert seen == 512 and pages > 4


def test_another_users_job_of_the_same_name_neither_reads_nor_overwrites_a_curve(start_memd):
    """Curves are kept per user (the uid the job's process runs as): `nobody` running a job
    named like root's learns its own curve beside root's, and each next run starts from its
    own. Before, one report under the name from anyone replaced the curve."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a job as another user")
    from nobody import as_nobody
    from realdaemon import free_port

    memd = start_memd(endpoint="tcp://127.0.0.1:%d" % free_port())  # a port nobody may connect to

    def run(peak_at_8):
        with client.Session("shared-name", endpoint=memd.endpoint, timeout=1.0, default_batch=4) as s:
            first = s.plan()
            for batch, peak in ((4, GB), (4, GB), (8, peak_at_8)):
                s.report(batch_size=batch, peak_bytes=peak)
            assert wait_for(lambda: reports(memd, "shared-name") == 3)
        assert wait_for(lambda: not memd.call("status")["sessions"])
        return [first.batch_size, first.reason]

    run(GB + 8 * 10 ** 8)  # root's run
    assert as_nobody(lambda: run(3 * GB))[1] == "starting at 4: no reports yet"  # not root's curve
    entries = {c["owner"]: c["points"] for c in curves(memd)}
    assert entries == {"uid:0": [[4, GB], [8, GB + 8 * 10 ** 8]], "uid:65534": [[4, GB], [8, 3 * GB]]}, entries
    batch, reason = run(GB + 8 * 10 ** 8)
    assert "from earlier runs of this job" in reason and batch == 8  # its own curve, untouched

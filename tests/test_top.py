"""`memd top`: the frame as a pure function of a status reply (columns, sort, legend, GPU
processes), this host's /proc read for users and commands, and the curses screen itself in a
real terminal (tmux, 80x24) over a real daemon that sees GPUs through the fake NVML driver."""
import functools
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from memd import client
from memd.top import MIN_REASON, SORT_KEYS, View, gpu_names, render
from memd.top_screen import process_labels
from realdaemon import Daemon, memd_env, run_memd
from realdaemon import wait_for as _wait_for

GiB = 2 ** 30
wait_for = functools.partial(_wait_for, timeout=15.0, step=0.1)


def _session(job, pid, pool, peak, budget, batch=8, latest=8, rank=None, ooms=0, throttle=False,
             reason="fits 8 in the budget"):
    return {"job": job, "pid": pid, "rank": rank, "pool": pool, "ooms": ooms, "latest_batch": latest,
            "latest_peak_bytes": peak, "budget_bytes": budget,
            "plan": {"batch_size": batch, "grad_accum_steps": 2, "num_workers": 4, "throttle": throttle,
                     "reason": reason}}


def _status(sessions, gpus=()):
    return {"version": "0.1.0", "host": "n1", "uptime_seconds": 65, "pressure_level": "ok",
            "snapshot": {"memory_model": "discrete", "errors": [], "pressure": None, "cgroup": None,
                         "system": {"total_bytes": 64 * GiB, "available_bytes": 48 * GiB,
                                    "swap_total_bytes": 0, "swap_used_bytes": 0},
                         "gpus": list(gpus)},
            "sessions": sessions}


GPUS = [
    {"index": 0, "uuid": "GPU-a", "name": "NVIDIA A100-SXM4-80GB", "healthy": True, "unified": False,
     "total_bytes": 80 * GiB, "used_bytes": 20 * GiB, "utilization": 0.25, "processes": []},  # MIG parent
    {"index": 0, "uuid": "MIG-a0", "mig_parent_uuid": "GPU-a", "name": "A100 MIG 3g.40gb", "healthy": True,
     "unified": False, "total_bytes": 40 * GiB, "used_bytes": 5 * GiB, "processes": []},
    {"index": 0, "uuid": "MIG-a1", "mig_parent_uuid": "GPU-a", "name": "A100 MIG 3g.40gb", "healthy": True,
     "unified": False, "total_bytes": 40 * GiB, "used_bytes": 15 * GiB,
     "processes": [{"pid": 300, "used_bytes": 15 * GiB}]},
    {"index": 1, "uuid": "GPU-b", "name": "NVIDIA H100 80GB HBM3", "healthy": True, "unified": False,
     "total_bytes": 80 * GiB, "used_bytes": 30 * GiB, "utilization": 0.9,
     "processes": [{"pid": 100, "used_bytes": 4 * GiB}, {"pid": 200, "used_bytes": 24 * GiB},
                   {"pid": 999, "used_bytes": None}]},
]
SESSIONS = [
    _session("bert", 100, "GPU-b", 3 * GiB, 40 * GiB, batch=16, latest=8, ooms=1,
             reason="growing back 8 -> 16 after an out-of-memory error three steps ago"),
    _session("llama-finetune-7b", 200, "GPU-b", 22 * GiB, 60 * GiB, batch=4, latest=4, rank=1),
    _session("vit", 300, "MIG-a1", 14 * GiB, 30 * GiB, batch=64, latest=64),
    _session("dataprep", 400, "host", 2 * GiB, 10 * GiB, batch=512, latest=512, throttle=True),
]
LABELS = {100: ("alice", "python bert.py"), 200: ("bob", "torchrun llama.py --nproc 8"), 300: ("carol", "vit")}


def _rows(text, first="SESSIONS", until=""):
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first)) + 2
    return lines[start:lines.index(until, start) if until in lines[start:] else len(lines)]


def test_every_line_fits_80_columns_and_the_reason_column_stays():
    text = render(_status(SESSIONS, GPUS), 80, View(), LABELS)
    assert max(len(line) for line in text.splitlines()) <= 80
    header = next(line for line in text.splitlines() if line.startswith("JOB"))
    assert header.split() == ["JOB", "PID", "GPU", "BATCH", "ACCUM", "WORKERS", "PEAK", "BUDGET", "OOMS", "REASON"]
    at = header.index("REASON")
    bert = next(line for line in text.splitlines() if line.startswith("bert "))
    assert len(bert[at:]) >= MIN_REASON and bert[at:].startswith("growing") and bert.endswith("~")
    wide = render(_status(SESSIONS, GPUS), 200, View(), LABELS)
    assert "after an out-of-memory error three steps ago" in wide  # whole where there is room
    assert "GiB" in text and " GB" not in text


def test_sessions_show_the_index_of_their_gpu_row():
    assert gpu_names(GPUS) == {"GPU-a": "0", "MIG-a0": "0:0", "MIG-a1": "0:1", "GPU-b": "1"}
    text = render(_status(SESSIONS, GPUS), 80, View(), LABELS)
    gpu_rows = {line.split()[0] for line in text.splitlines()[5:] if line[:1].isdigit()}
    assert gpu_rows == {"0", "0:0", "0:1", "1"}
    by_job = {line.split()[0]: line.split()[2] for line in _rows(text, until="")}
    assert by_job == {"bert": "1", "llama-fin~#1": "1", "vit": "0:1", "dataprep": "host"}
    assert "GPU-b" not in text  # no uuid, cut or whole


def test_gpu_processes_sit_under_their_gpu_with_user_command_and_memory():
    text = render(_status(SESSIONS, GPUS), 80, View(), LABELS).splitlines()
    h100 = next(i for i, line in enumerate(text) if line.startswith("1    NVIDIA H100"))
    procs = [line.split(None, 3) for line in text[h100 + 1:h100 + 4]]
    # biggest first; a session's process carries its job; an unknown pid and size show "-"
    assert procs == [["200", "bob", "24.0", "[llama-finetune-7b] torchrun llama.py --nproc 8"],
                     ["100", "alice", "4.0", "[bert] python bert.py"], ["999", "-", "-", "-"]]
    mig = next(i for i, line in enumerate(text) if line.startswith("0:1 "))
    assert text[mig + 1].split() == ["300", "carol", "15.0", "[vit]", "vit"]
    assert [line.split()[:3] for line in text if line.startswith("GPU ") or line.lstrip().startswith("PID")] == [
        ["GPU", "NAME", "MEMORY"], ["PID", "USER", "GPU"]]
    by_pid = render(_status(SESSIONS, GPUS), 80, View(sort="pid"), LABELS).splitlines()
    assert [line.split()[0] for line in by_pid[h100 + 1:h100 + 4]] == ["100", "200", "999"]


def test_each_sort_key_orders_the_sessions_and_r_reverses_it():
    def order(view):
        return [line.split()[0] for line in _rows(render(_status(SESSIONS, GPUS), 80, view, LABELS), until="")]

    expected = {"gpu": ["vit", "bert", "llama-fin~#1", "dataprep"],  # by GPU row, the host last
                "job": ["bert", "dataprep", "llama-fin~#1", "vit"],
                "pid": ["bert", "llama-fin~#1", "vit", "dataprep"],
                "memory": ["llama-fin~#1", "vit", "bert", "dataprep"],  # biggest peak first
                "batch": ["dataprep", "vit", "bert", "llama-fin~#1"],
                "budget": ["llama-fin~#1", "bert", "vit", "dataprep"],
                "ooms": ["bert", "dataprep", "llama-fin~#1", "vit"]}  # ties by job
    assert set(expected) == set(SORT_KEYS)
    for key, jobs in expected.items():
        assert order(View(sort=key)) == jobs, key
    assert order(View(sort="memory", reverse=True)) == ["dataprep", "bert", "vit", "llama-fin~#1"]
    view = View()
    seen = [view.sort]
    for _ in SORT_KEYS:
        view = view.next_sort(1)
        seen.append(view.sort)
    assert seen == list(SORT_KEYS) + ["gpu"] and View(sort="gpu").next_sort(-1).sort == "ooms"
    assert "sorted by PEAK/GPU GiB, smallest first" in render(_status(SESSIONS), 80, View("memory", True))


def test_legend_explains_the_columns_and_whole_reasons_show_on_request():
    text = render(_status(SESSIONS, GPUS), 80, View(), LABELS)
    legend = text.split("\n\n")[-1]
    for word in ("BATCH: planned<-last used", "ACCUM: gradient accumulation steps", "WORKERS: data loader",
                 "PEAK: last step's peak GiB", "BUDGET: GiB it may use", "OOMS: out-of-memory errors",
                 "JOB#N: rank N"):
        assert word in legend, word
    assert "dataprep" in text and "4 paused" in text  # what was the unexplained "T" column
    assert "BATCH:" not in render(_status(SESSIONS, GPUS), 80, View(legend=False), LABELS)
    assert "BATCH:" not in render(_status([]), 80)  # no sessions, no columns to explain
    whole = render(_status(SESSIONS, GPUS), 80, View(reasons=True), LABELS).splitlines()
    at = next(i for i, line in enumerate(whole) if line.startswith("bert "))
    assert whole[at + 1:at + 3] == ["    growing back 8 -> 16 after an out-of-memory error three steps ago"] + [
        whole[at + 2]] and whole[at + 2].startswith("llama")


def test_process_labels_read_this_hosts_proc_and_nothing_for_another_host():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert wait_for(lambda: open("/proc/%d/cmdline" % child.pid, "rb").read() == b"sleep\0" + b"30\0")  # exec'd
        status = _status([_session("j", os.getpid(), "host", GiB, GiB)],
                         [dict(GPUS[3], processes=[{"pid": child.pid, "used_bytes": GiB},
                                                   {"pid": 2 ** 22 + 1, "used_bytes": GiB}])])
        status["host"] = "here"
        labels = process_labels(status, hostname="here")
        me = pwd.getpwuid(os.getuid()).pw_name
        assert labels[child.pid] == (me, "sleep 30")
        assert labels[os.getpid()][0] == me and "python" in labels[os.getpid()][1]
        assert 2 ** 22 + 1 not in labels  # no such process: no label, shown as "-"
        assert process_labels(status, hostname="elsewhere") == {}  # its pids are another host's
    finally:
        child.kill()
        child.wait()
    zombie = subprocess.Popen(["true"])  # exited, not yet waited for: no command line, as ps shows it
    try:
        assert wait_for(lambda: open("/proc/%d/stat" % zombie.pid).read().rsplit(")", 1)[1].split()[0] == "Z")
        status["sessions"][0]["pid"] = zombie.pid
        assert process_labels(status, hostname="here")[zombie.pid] == (me, "[true]")
    finally:
        zombie.wait()


def test_a_pipe_gets_one_plain_frame_and_a_bad_sort_is_refused(memd):
    out = run_memd(["top", "--endpoint", memd.endpoint, "--sort", "memory"], timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("memd ") and "\x1b" not in out.stdout and out.stdout.count("memd ") == 1
    out = run_memd(["top", "--once", "--sort", "size", "--endpoint", memd.endpoint])
    assert out.returncode == 2 and "--sort" in out.stderr and "size" in out.stderr


# ---- a real terminal ----

FAKE_GPUS = """
driver 550.54.15
gpu GPU-11111111-aaaa total=80GiB used=10GiB util=40 name=NVIDIA H100 80GB HBM3
gpu GPU-22222222-bbbb total=80GiB used=30GiB util=90 name=NVIDIA H100 80GB HBM3
proc GPU-11111111-aaaa {sleeper} 3GiB
proc GPU-22222222-bbbb {me} 20GiB
"""


class Tmux:
    """One tmux server on its own socket, one 80x24 window running a command."""

    def __init__(self, tmp_path):
        self.socket = str(tmp_path / "tmux.sock")

    def __call__(self, *args):
        return subprocess.run(["tmux", "-S", self.socket, "-f", "/dev/null"] + list(args),
                              capture_output=True, text=True, timeout=10)

    def screen(self):
        return self("capture-pane", "-p", "-t", "top").stdout

    def seen(self, *words):
        return wait_for(lambda: self.screen() if all(w in self.screen() for w in words) else None)


@pytest.fixture
def tmux(tmp_path):
    if shutil.which("tmux") is None:
        if os.environ.get("CI"):
            pytest.fail("tmux not found: CI installs it (.ci/run)")
        pytest.skip("tmux not found: the terminal test needs it (apt-get install tmux)")
    t = Tmux(tmp_path)
    yield t
    t("kill-server")


def test_top_in_a_real_80x24_terminal_sorts_on_keys_and_quits_on_q(tmp_path, fake_nvml, tmux):
    sleeper = subprocess.Popen(["sleep", "60"])
    assert wait_for(lambda: open("/proc/%d/cmdline" % sleeper.pid, "rb").read().startswith(b"sleep"))
    fake_nvml.write(FAKE_GPUS.format(sleeper=sleeper.pid, me=os.getpid()))
    memd = Daemon(tmp_path, env={**fake_nvml.env({}), "MEMD_JOB_INTERVAL": "0.1"}).start()
    sessions = []
    try:
        for job, peak in (("alpha", 1), ("beta", 5)):
            s = client.Session(job, endpoint=memd.endpoint, timeout=1.0, default_batch=4)
            sessions.append(s.__enter__())
            s.plan()
            s.report(batch_size=4, peak_bytes=peak * GiB)
        assert wait_for(lambda: [v["pool"] for v in memd.call("status")["sessions"]] == ["GPU-22222222-bbbb"] * 2)
        env = memd_env()
        command = "cd %s && env PYTHONPATH=%s %s -m memd top --endpoint %s --sort job; echo exit=$? > %s" % (
            shlex.quote(os.getcwd()), shlex.quote(env["PYTHONPATH"]), shlex.quote(sys.executable),
            memd.endpoint, tmp_path / "exit")
        assert tmux("new-session", "-d", "-s", "top", "-x", "80", "-y", "24", command).returncode == 0
        screen = tmux.seen("SESSIONS 2", "sorted by JOB")
        assert screen, tmux.screen()
        lines = screen.splitlines()
        assert len(lines) == 24 and max(len(line) for line in lines) <= 80
        gpu_header = next(line for line in lines if line.startswith("GPU "))
        assert gpu_header.split()[:3] == ["GPU", "NAME", "MEMORY"]
        gpu1 = next(i for i, line in enumerate(lines) if line.startswith("1    NVIDIA H100"))
        assert lines[gpu1 + 1].split()[:3] == [str(os.getpid()), pwd.getpwuid(os.getuid()).pw_name, "20.0"]
        gpu0 = next(i for i, line in enumerate(lines) if line.startswith("0    NVIDIA H100"))
        assert lines[gpu0 + 1].split()[1:] == [pwd.getpwuid(os.getuid()).pw_name, "3.0", "sleep", "60"]
        header = next(line for line in lines if line.startswith("JOB"))
        assert "REASON" in header and "ACCUM" in header

        def jobs(screen):
            return [line.split()[0] for line in screen.splitlines() if line.split()[:1] in (["alpha"], ["beta"])]

        rows = [line for line in lines if line.startswith(("alpha", "beta"))]
        assert [row.split()[2] for row in rows] == ["1", "1"]  # the GPU row's index, not a uuid
        assert all(len(row) > header.index("REASON") for row in rows)  # a reason, even at 80 columns
        assert jobs(screen) == ["alpha", "beta"]
        assert "ACCUM: gradient accumulation steps" in screen and "q quit" in lines[-1] and "sort" in lines[-1]

        tmux("send-keys", "-t", "top", "r")
        screen = tmux.seen("sorted by JOB/COMMAND, Z to A")
        assert screen and jobs(screen) == ["beta", "alpha"]
        tmux("send-keys", "-t", "top", ">", ">")  # job -> pid -> PEAK: 5 GiB before 1 GiB
        screen = tmux.seen("sorted by PEAK/GPU GiB, largest first")
        assert screen and jobs(screen) == ["beta", "alpha"]
        tmux("send-keys", "-t", "top", "r")
        screen = tmux.seen("smallest first")
        assert screen and jobs(screen) == ["alpha", "beta"]
        tmux("send-keys", "-t", "top", "l")
        assert wait_for(lambda: "ACCUM: gradient" not in tmux.screen())

        # No flicker: once drawn, frames (uptime ticks each second) rewrite what changed; no clear.
        written = tmp_path / "written"
        tmux("pipe-pane", "-t", "top", "-o", "cat >> %s" % written)
        up = [line for line in tmux.screen().splitlines() if line.startswith("memd ")][0]
        assert wait_for(lambda: up not in tmux.screen() and written.exists() and written.stat().st_size)
        time.sleep(1.5)
        assert b"\x1b[2J" not in written.read_bytes() and b"\x1b[H\x1b[J" not in written.read_bytes()

        tmux("send-keys", "-t", "top", "q")
        assert wait_for(lambda: (tmp_path / "exit").exists() and (tmp_path / "exit").read_text().strip())
        assert (tmp_path / "exit").read_text().strip() == "exit=0"
    finally:
        for s in sessions:
            s.__exit__(None, None, None)
        memd.stop()
        sleeper.kill()
        sleeper.wait()

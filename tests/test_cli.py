"""The command line as a user runs it: real subprocesses, real exit codes, one-line errors."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

from realdaemon import Daemon, memd_env, run_memd


def test_serve_refuses_unknown_config_key(tmp_path):
    config = tmp_path / "memd.toml"
    config.write_text('interval = 0.5\nintervall = 2\n')
    out = run_memd(["serve", "--config", str(config), "--endpoint", "ipc://%s/m.sock" % tmp_path])
    assert out.returncode == 2
    assert "intervall" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_serve_refuses_mistyped_value_from_env(tmp_path):
    out = run_memd(["serve", "--endpoint", "ipc://%s/m.sock" % tmp_path], env={"MEMD_INTERVAL": "fast"})
    assert out.returncode == 2
    assert "MEMD_INTERVAL" in out.stderr and "Traceback" not in out.stderr


def test_serve_refuses_bad_policy_key(tmp_path):
    config = tmp_path / "memd.toml"
    config.write_text('[policy]\nmargin_ration = 0.1\n')
    out = run_memd(["serve", "--config", str(config), "--endpoint", "ipc://%s/m.sock" % tmp_path])
    assert out.returncode == 2 and "margin_ration" in out.stderr


def test_serve_refuses_bad_endpoint(tmp_path):
    for endpoint in ("udp://127.0.0.1:5", "tcp://0.0.0.0:5555", "tcp://127.0.0.1", "ipc://"):
        out = run_memd(["serve", "--endpoint", endpoint, "--metrics-address", "off"])
        assert out.returncode == 2, endpoint
        assert "endpoint" in out.stderr and "Traceback" not in out.stderr


def test_busy_metrics_port_names_the_flag(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_memd(["serve", "--endpoint", "ipc://%s/m.sock" % tmp_path, "--metrics-address",
                        "127.0.0.1:%d" % port, "--state-dir", str(tmp_path / "s")])
    assert out.returncode == 2
    assert "--metrics-address" in out.stderr and "in use" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert out.stdout == ""  # only why: not what NVML said on the way (it samples after binding)


def test_busy_endpoint_is_refused_and_left_alone(memd, tmp_path):
    out = run_memd(["serve", "--endpoint", memd.endpoint, "--metrics-address", "off",
                    "--state-dir", str(tmp_path / "s2")])
    assert out.returncode == 2 and "in use" in out.stderr and out.stdout == ""
    assert memd.call("ping")["pong"] is True  # the running daemon kept its socket


def test_stale_socket_file_is_replaced(tmp_path):
    path = tmp_path / "stale.sock"
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(path))  # a socket file nobody listens on, as after a crash
    leftover.close()
    daemon = Daemon(tmp_path, endpoint="ipc://%s" % path).start()
    try:
        assert daemon.call("ping")["pong"] is True
    finally:
        daemon.stop()


def test_sigterm_removes_socket_and_flushes_state(memd, tmp_path):
    memd.call("hello", job="j", pid=1, host="elsewhere")
    socket_path = memd.endpoint[len("ipc://"):]
    assert memd.stop() == 0
    import os
    assert not os.path.exists(socket_path)
    assert '"event": "memd_stopped"' in memd.log()


def test_status_without_daemon_exits_1(tmp_path):
    out = run_memd(["status", "--endpoint", "ipc://%s/none.sock" % tmp_path])
    assert out.returncode == 1
    assert "memd serve" in out.stderr and "Traceback" not in out.stderr


def test_status_shows_sessions(memd):
    memd.call("hello", job="visible-job", pid=1, host="elsewhere", default_batch=12)
    out = run_memd(["status", "--endpoint", memd.endpoint, "--json"])
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["snapshot"]["system"]["total_bytes"] > 0
    assert [s["plan"]["batch_size"] for s in data["sessions"]] == [12]
    human = run_memd(["status", "--endpoint", memd.endpoint])
    assert human.returncode == 0 and "visible-job" in human.stdout


def test_sample_json_matches_proc(tmp_path):
    out = run_memd(["sample", "--json"])
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    with open("/proc/meminfo") as f:
        mem_total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert data["system"]["total_bytes"] == mem_total
    assert set(data["system"]) == {"total_bytes", "available_bytes", "used_bytes", "swap_total_bytes",
                                   "swap_used_bytes"}
    assert data["memory_model"] in ("discrete", "unified", "cpu")
    if data["pressure"] is not None:
        for key in ("some_avg10", "some_avg60", "some_avg300", "full_avg10", "full_avg60", "full_avg300"):
            assert 0.0 <= data["pressure"][key] <= 1.0
    assert isinstance(data["gpus"], list)
    assert "processes" not in data


def test_sample_with_pid_lists_the_tree(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import os, time; os.fork() or time.sleep(30); time.sleep(30)"],
                             start_new_session=True)
    try:
        import time
        time.sleep(0.3)
        out = run_memd(["sample", "--json", "--pid", str(child.pid)])
        data = json.loads(out.stdout)
        pids = [p["pid"] for p in data["processes"]]
        assert pids[0] == child.pid and len(pids) == 2
        assert all(p["rss_bytes"] > 0 for p in data["processes"])
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def test_python_dash_m_and_console_script_agree():
    out = subprocess.run([sys.executable, "-m", "memd", "--version"], env=memd_env(), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("memd ")


def test_top_shows_host_and_sessions_recommended_vs_used(memd):
    from memd import client

    with client.Session("top-job", endpoint=memd.endpoint, timeout=1.0, default_batch=4,
                        target_effective_batch=64) as s:
        s.plan()
        s.report(batch_size=4, peak_bytes=10 ** 9)  # the warm-up step: the plan waits for a second
        s.report(batch_size=4, peak_bytes=10 ** 9)
        deadline = time.monotonic() + 5
        while s.plan().batch_size == 4 and time.monotonic() < deadline:
            pass
        plan = s.plan()
        out = run_memd(["top", "--once", "--endpoint", memd.endpoint])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("memd ") and "pressure" in lines[0]
    assert any(line.startswith("host ") and "GiB used" in line for line in lines)
    row = [line for line in lines if line.startswith("top-job")][0]
    assert plan.batch_size > 4 and "%d<-4" % plan.batch_size in row  # recommended <- last used


def test_top_without_daemon_says_so(tmp_path):
    out = run_memd(["top", "--once", "--endpoint", "ipc://%s/none.sock" % tmp_path])
    assert out.returncode == 1 and "memd serve" in out.stderr and out.stdout == ""


def test_top_render_marks_unhealthy_and_unified_gpus():
    from memd.top import render

    status = {"version": "0.1.0", "host": "n1", "uptime_seconds": 4000, "pressure_level": "high",
              "snapshot": {"memory_model": "discrete",
                           "system": {"total_bytes": 64 * 2 ** 30, "available_bytes": 16 * 2 ** 30,
                                      "swap_total_bytes": 0, "swap_used_bytes": 0},
                           "pressure": None, "cgroup": None, "errors": [{"source": "nvml", "message": "GPU lost"}],
                           "gpus": [{"index": 0, "name": "H100", "healthy": False, "error": "GPU is lost"},
                                    {"index": 1, "name": "GB10", "healthy": True, "unified": True, "total_bytes": None},
                                    {"index": 2, "name": "A100", "healthy": True, "unified": False,
                                     "total_bytes": 40 * 2 ** 30, "used_bytes": 30 * 2 ** 30, "utilization": 0.5}]},
              "sessions": []}
    text = render(status, width=120)
    assert "up 1h06m" in text and "HIGH" in text
    assert "[##################......]  75%" in text  # host: 48 of 64 GiB used
    assert "UNHEALTHY: GPU is lost" in text and "unified (host RAM)" in text
    assert "30.0/40.0" in text and " 50%" in text
    assert "psi   not available" in text and "! nvml: GPU lost" in text


def test_bad_timeouts_and_absent_pids_are_refused_with_one_line():
    """`status --timeout -1` waited no time and said the daemon was absent; `sample --pid
    999999` printed the machine and exited 0 ("vanished"). Each now says what is wrong, names the
    flag, and exits non-zero."""
    for value in ("-1", "0", "abc", "1e9"):
        out = run_memd(["status", "--timeout", value])
        assert out.returncode == 2 and "argument --timeout" in out.stderr, (value, out.stderr)
    out = run_memd(["sample", "--pid", "999999999"])
    assert out.returncode == 1 and out.stderr.strip() == "memd: no process 999999999 here (--pid)"
    out = run_memd(["sample", "--pid", str(os.getpid())])  # a live one still reads
    assert out.returncode == 0 and "processes of %d" % os.getpid() in out.stdout

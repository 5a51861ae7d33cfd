"""The command line as a user runs it: real subprocesses, real exit codes, one-line errors."""
import json
import os
import signal
import socket
import subprocess
import sys

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


def test_busy_endpoint_is_refused_and_left_alone(memd, tmp_path):
    out = run_memd(["serve", "--endpoint", memd.endpoint, "--metrics-address", "off", "--state-dir", str(tmp_path / "s2")])
    assert out.returncode == 2 and "in use" in out.stderr
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
    assert '"event": "memd stopped"' in memd.log()


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
    assert set(data["system"]) == {"total_bytes", "available_bytes", "used_bytes", "swap_total_bytes", "swap_used_bytes"}
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

"""Issue 14's list of bad input, each as a user meets it: the real CLI in a subprocess, one line
on stderr naming the key and where its value came from, a non-zero exit, no traceback, nothing
started (and nothing printed before the error)."""
import os
import socket
import subprocess
import sys

import pytest

from realdaemon import memd_env, run_memd


def refused(out, *words: str, code: int = 2) -> None:
    """One line on stderr holding each of ``words``; exit ``code``; nothing on stdout."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and out.stdout == "", (out.stdout, out.stderr)
    assert len(lines) == 1, out.stderr
    for word in words:
        assert word in lines[-1], (word, lines[-1])


def serve(tmp_path, *args: str, env=None):
    return run_memd(["serve", "--endpoint", "ipc://%s/m.sock" % tmp_path, "--metrics-address", "off",
                     "--state-dir", str(tmp_path / "state")] + list(args), env=env)


def test_a_config_file_that_is_not_utf8(tmp_path):
    config = tmp_path / "memd.toml"
    config.write_bytes(b'interval = 0.5\n# \xff\xfe latin-1 comment \xe9\n')
    refused(serve(tmp_path, "--config", str(config)), str(config), "UTF-8")


@pytest.mark.parametrize("where", ["file", "env", "flag"])
def test_a_range_error_names_where_the_value_came_from(tmp_path, where):
    config = tmp_path / "memd.toml"
    config.write_text("interval = -5\n" if where == "file" else "")
    args = ["--config", str(config)] + (["--interval", "-5"] if where == "flag" else [])
    out = serve(tmp_path, *args, env={"MEMD_INTERVAL": "-5"} if where == "env" else None)
    source = {"file": "interval in %s" % config, "env": "MEMD_INTERVAL", "flag": "--interval"}[where]
    refused(out, "'interval'", "(%s)" % source)
    if where == "file":
        assert "--interval" not in out.stderr  # a file's value is never blamed on a flag


def test_a_flag_overrides_a_bad_file_value_without_blame(tmp_path):
    # The file says -5, the flag says 0.5: the flag wins and the daemon would start; a bad
    # job_interval in the file is then named with the file, not the flag.
    config = tmp_path / "memd.toml"
    config.write_text("interval = -5\njob_interval = 0.01\n")
    out = serve(tmp_path, "--config", str(config), "--interval", "0.5")
    refused(out, "'job_interval'", "(job_interval in %s)" % config)


def test_status_refuses_a_negative_timeout(tmp_path):
    out = run_memd(["status", "--endpoint", "ipc://%s/none.sock" % tmp_path, "--timeout", "-1"])
    assert out.returncode == 2 and "--timeout" in out.stderr.strip().splitlines()[-1], out.stderr
    assert "no daemon" not in out.stderr  # refused before anything is asked


def _unused_pid() -> int:
    pid = 999999
    while os.path.exists("/proc/%d" % pid):
        pid -= 1
    return pid


def test_sample_of_a_process_that_does_not_exist_fails():
    pid = _unused_pid()
    refused(run_memd(["sample", "--pid", str(pid)]), "--pid", str(pid), code=1)


@pytest.mark.parametrize("where", ["flag", "file", "env"])
def test_an_unwritable_state_dir_is_refused_at_start(tmp_path, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory under a file: refused for root too
    state = str(blocker / "state")
    config = tmp_path / "memd.toml"
    config.write_text('state_dir = "%s"\n' % state if where == "file" else "")
    args = ["serve", "--endpoint", "ipc://%s/m.sock" % tmp_path, "--metrics-address", "off", "--config", str(config)]
    args += ["--state-dir", state] if where == "flag" else []
    out = run_memd(args, env={"STATE_DIRECTORY": state} if where == "env" else None)
    source = {"flag": "--state-dir", "file": "state_dir in %s" % config, "env": "$STATE_DIRECTORY"}[where]
    refused(out, "'state_dir'", state, "(%s)" % source)
    assert not os.path.exists("%s/m.sock" % tmp_path)  # nothing started


def test_a_failing_serve_prints_only_its_error(tmp_path):
    """No NVML or other log line before the error: a port taken by another process."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_memd(["serve", "--endpoint", "ipc://%s/m.sock" % tmp_path, "--state-dir", str(tmp_path / "s"),
                        "--metrics-address", "127.0.0.1:%d" % port])
    refused(out, "127.0.0.1:%d" % port, "--metrics-address")


def test_lora_params_above_the_model_are_refused():
    out = run_memd(["estimate", "llm", "--lora-params", "9B", "--params", "8B"])
    assert out.returncode == 2 and out.stdout == "", out
    line = out.stderr.strip().splitlines()[-1]
    assert "trainable" in line and "8.00B" in line and "Traceback" not in out.stderr


def test_transformer_precision_changes_the_table():
    arch = ["estimate", "transformer", "--layers", "12", "--d-model", "768", "--heads", "12", "--vocab", "50257",
            "--seq-len", "1024", "--batch", "8"]
    fp32, bf16 = run_memd(arch), run_memd(arch + ["--precision", "bf16"])
    assert fp32.returncode == bf16.returncode == 0, (fp32.stderr, bf16.stderr)
    assert "bf16" in bf16.stdout.splitlines()[1] and "bf16" not in fp32.stdout
    assert fp32.stdout != bf16.stdout


def test_suggest_batch_with_a_default_that_is_not_a_number_returns_an_int(tmp_path):
    code = "from memd import client; b = client.suggest_batch(default='big'); print(type(b).__name__, b)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env=memd_env({"MEMD_ENDPOINT": "ipc://%s/none.sock" % tmp_path}))
    assert out.returncode == 0 and out.stdout.split()[0] == "int", (out.stdout, out.stderr)
    assert "default" in out.stderr  # said once, not silently

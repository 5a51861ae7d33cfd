"""Short runs of the fuzzer and the load generator (bench/fuzz.py, bench/load.py; issue 12)
against the real daemon, asserting what does not depend on timing: no crash, every message
answered, no internal error, RSS bound, no client lost or blocked past its timeout, no corrupt
state file. Latencies and CPU are benchmark output (docs/results.md), not asserted here; the
clients get a generous timeout so that a loaded CI machine does not fail them."""
import json
import os
import shutil
import subprocess
import sys

from realdaemon import PYTHONPATH, ROOT


def run_bench(tmp_path, script, *args):
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "bench/%s" % script, *args, "--json", str(out)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=PYTHONPATH), capture_output=True, text=True, timeout=120)
    assert out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_fuzz_20000_malformed_frames_no_crash_every_one_answered(tmp_path):
    gpus = ["--fake-gpus"] if shutil.which("gcc") else []  # the GPU paths of hello and plan too
    summary = run_bench(tmp_path, "fuzz.py", "--frames", "20000", "--bulk", "2", "--probe-timeout", "1", *gpus)
    checks = summary["checks"]
    for check in ("frames sent", "no crash", "every message answered", "no internal error",
                  "out-of-range numbers refused", "RSS under 100 MB (mixed)", "probe always served"):
        assert checks[check], (check, summary)
    assert summary["crashes"] == [] and summary["exit_codes"] == [0, 0]
    assert set(summary["replies_by_code"]) <= {"ok", "bad_request", "too_large", "unsupported_version",
                                               "unknown_op", "invalid", "unknown_session", "too_many_sessions"}


def test_load_few_clients_nothing_lost(tmp_path):
    summary = run_bench(tmp_path, "load.py", "--clients", "4", "--rate", "50", "--seconds", "2", "--idle", "0.5")
    assert summary["checks"] == {"0 lost": True, "no error replies": True, "daemon exited 0": True}, summary
    assert summary["answered"] == summary["sent"] == 400


def test_kill_mid_training_no_corrupt_state_no_client_harmed(tmp_path):
    summary = run_bench(tmp_path, "load.py", "--mode", "kill", "--kills", "2", "--settle", "1", "--timeout", "0.5",
                        "--flush-interval", "0.1", "--during-writes")
    assert summary["kills"] == 2 and summary["corrupt_state_files"] == 0, summary
    assert summary["temp_files_left_after_restart"] == 0
    assert summary["clients_crashed"] == 0 and summary["calls_past_timeout"] == 0, summary
    assert summary["steps"] > 0

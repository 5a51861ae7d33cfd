"""A job the kernel's OOM killer ends teaches its next run: real jobs (bench/examjob.py) in real
memory cgroups, against the real daemon.

Before, a killed job's session was closed as "expired" with no OOM and no ceiling, and its next
run started at the same default and was killed again (six restarts in a 1.5 GiB group, each
planned at four times what fits). Now the kill is an out-of-memory at the batch it ran: the
curve's ceiling, with its cause, and the next run starts below it, from what is known to fit.
"""
import json
import os
import subprocess
import sys

import pytest

from bench import memcg
from realdaemon import ROOT, memd_env, run_memd, wait_for

pytestmark = pytest.mark.skipif(memcg.available() is not None, reason="needs a writable memory cgroup (root): %s"
                                % memcg.available())
MiB = 2 ** 20
LIMIT = 256 * MiB
SPEC = {"kind": "private", "fixed_mib": 16, "sample_kib": 4096, "step_ms": 50}  # 4 MiB a sample: about 50 fit


def run_job(memd, method, default, steps, name="killed-once"):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "examjob.py"), "--spec", json.dumps(SPEC), "--method",
           method, "--default-batch", str(default), "--steps", str(steps), "--job", name]
    with memcg.MemoryCgroup(LIMIT) as cg:
        out = subprocess.run(cmd, env=memd_env({"MEMD_ENDPOINT": memd.endpoint}), capture_output=True, text=True,
                             timeout=120, preexec_fn=cg.join)
        kills = cg.oom_kills()
    steps = [json.loads(line)["batch"] for line in out.stdout.splitlines() if line.startswith('{"e": "step"')]
    return out, kills, steps


@pytest.mark.parametrize("method", ["session", "suggest"])
def test_a_killed_run_teaches_its_restart_to_start_below_the_kill(memd, method):
    out, kills, steps = run_job(memd, method, default=400, steps=5, name="killed-" + method)
    assert kills >= 1 and out.returncode == -9 and steps == [], (out.returncode, steps)  # 400 x 4 MiB in 256 MiB
    def learned():  # at the daemon's next housekeeping (each second), or at the restart's hello
        curves = json.loads(run_memd(["curves", "--json", "--endpoint", memd.endpoint]).stdout)
        return [c for c in curves if c["job"] == "killed-" + method]

    [curve] = wait_for(learned)
    assert curve["ceiling"] == 399 and curve["ceiling_cause"] == "kill", curve
    assert "oom_kill_learned" in memd.log()
    out, kills, steps = run_job(memd, method, default=400, steps=30, name="killed-" + method)
    assert kills == 0 and out.returncode == 0, out.stderr[-2000:]
    assert steps[0] == 1 and max(steps) > 8, steps  # below the kill, then up, without a second one
    shown = run_memd(["curves", "--endpoint", memd.endpoint]).stdout
    assert "399 (kill: the kernel's OOM killer ended a run above it" in shown, shown

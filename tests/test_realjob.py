"""A real training job under a real memory limit, taking its batch from the real daemon.

bench/realjobs.py measures this at length, beside the peers (docs/results.md). Here one short
case runs in CI: the benchmark's GPT-style job (bench/trainjob.py, real PyTorch steps on the
CPU) in a 640 MiB cgroup, with `suggest_batch()` alone, the mission's headline use. Nothing is
reported by the job: the daemon measures each step, learns the curve, and the job grows into
its cgroup without being killed.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
from bench import memcg  # noqa: E402
from realdaemon import ROOT, memd_env  # noqa: E402

pytestmark = pytest.mark.skipif(memcg.available() is not None, reason="needs a writable memory cgroup (root): %s"
                                % memcg.available())
LIMIT = 640 * 2 ** 20


def run_job(memd, method, steps, limit=LIMIT):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "trainjob.py"), "--shape", "gpt", "--method", method,
           "--steps", str(steps), "--default-batch", "4", "--job", "ci-realjob"]
    with memcg.MemoryCgroup(limit) as cg:
        out = subprocess.run(cmd, env=memd_env({"MEMD_ENDPOINT": memd.endpoint}), capture_output=True, text=True,
                             timeout=300, preexec_fn=cg.join)
        killed, peak = cg.oom_kills() > 0, cg.peak_bytes()
    steps = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"e": "step"')]
    return out, killed, peak, steps


def test_suggest_batch_alone_grows_a_real_job_into_its_cgroup_without_a_kill(memd):
    out, killed, peak, steps = run_job(memd, "suggest", 40)  # past its first 24 steps' reserve (spike_steps)
    assert not killed and out.returncode == 0, out.stderr[-2000:]
    batches = [s["batch"] for s in steps]
    assert batches[0] == 4  # the default, before anything is known
    assert max(batches) >= 3 * batches[0], batches  # it learned from the steps it was never told about
    assert peak >= 0.8 * LIMIT, (peak, batches)  # and uses most of its pool (measured: 597-604 MiB)

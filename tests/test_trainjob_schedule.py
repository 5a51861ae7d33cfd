"""bench/trainjob.py's fixed runs that follow a path of batch sizes (``--schedule``), as an adaptive
method's job does before it settles: real PyTorch steps of the tiny shape, no daemon, no cgroup."""
import json
import os
import sys

import pytest

pytest.importorskip("torch")
from realdaemon import ROOT  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
import trainjob  # noqa: E402


def steps_of(capsys, *args):
    trainjob.main(["--shape", "tiny", "--method", "fixed", "--batch", "4", *args])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"e": "step"')]


def test_a_schedule_runs_each_batch_for_its_steps_then_the_batch(capsys):
    assert [s["batch"] for s in steps_of(capsys, "--schedule", "2:2,3:1", "--steps", "5")] == [2, 2, 3, 4, 4]
    assert [s["batch"] for s in steps_of(capsys, "--switch-from", "2", "--switch-after", "1", "--steps", "3")] == \
        [2, 4, 4]


@pytest.mark.parametrize("bad", ["2:x", "2", "0:3", "2:1,"])
def test_a_bad_schedule_is_refused_before_the_job_starts(capsys, bad):
    with pytest.raises(SystemExit, match="--schedule wants BATCH:STEPS"):
        trainjob.main(["--shape", "tiny", "--method", "fixed", "--batch", "4", "--schedule", bad])
    assert '"e": "start"' not in capsys.readouterr().out

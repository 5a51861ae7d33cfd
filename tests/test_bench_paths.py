"""Fixed runs that follow a path of batch sizes (bench/trainjob.py ``--schedule``), as an adaptive
method's job does before it settles: real PyTorch steps of the tiny shape, no daemon, no cgroup;
and bench/composition.py, which never takes such a run for a probe of one batch."""
import json

import pytest


def test_a_run_that_changed_its_batch_is_no_probe_of_one(tmp_path):
    from bench import composition

    run = tmp_path / "path.jsonl"
    run.write_text("")
    steps = [{"e": "step", "i": i, "batch": 32 if i < 2 else 117, "dt": 0.4} for i in range(4)]
    (tmp_path / "path.jsonl.steps").write_text("".join(json.dumps(e) + "\n" for e in steps + [{"e": "end"}]))
    with pytest.raises(SystemExit, match="changed its batch"):
        composition.record("workers-2g", [str(run)], str(tmp_path / "results.json"))
    assert not (tmp_path / "results.json").exists()


def trainjob():
    pytest.importorskip("torch")
    from bench import trainjob
    return trainjob


def steps_of(capsys, *args):
    trainjob().main(["--shape", "tiny", "--method", "fixed", "--batch", "4", *args])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"e": "step"')]


def test_a_schedule_runs_each_batch_for_its_steps_then_the_batch(capsys):
    assert [s["batch"] for s in steps_of(capsys, "--schedule", "2:2,3:1", "--steps", "5")] == [2, 2, 3, 4, 4]
    assert [s["batch"] for s in steps_of(capsys, "--switch-from", "2", "--switch-after", "1", "--steps", "3")] == \
        [2, 4, 4]


@pytest.mark.parametrize("bad", ["2:x", "2", "0:3", "2:1,"])
def test_a_bad_schedule_is_refused_before_the_job_starts(capsys, bad):
    with pytest.raises(SystemExit, match="--schedule wants BATCH:STEPS"):
        trainjob().main(["--shape", "tiny", "--method", "fixed", "--batch", "4", "--schedule", bad])
    assert '"e": "start"' not in capsys.readouterr().out


def test_a_schedule_and_a_switch_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        trainjob().main(["--shape", "tiny", "--method", "fixed", "--batch", "4", "--schedule", "2:1",
                         "--switch-from", "3", "--switch-after", "1"])
    assert "give one" in capsys.readouterr().err


def test_a_run_is_at_the_bar_from_the_step_after_which_it_never_fell_below():
    from bench.realjobs import held_from

    # the four-workers report run's path in short: 32 while its workers copy, 127, 138, then cuts to 125
    batches = [32, 32, 37, 74, 127, 138, 135, 129, 125]
    assert held_from(batches, 0.95 * 129) == 4
    assert held_from(batches[:-1] + [120], 0.95 * 129) is None  # ended below the bar: never reached
    assert held_from([130, 120, 130], 0.95 * 129) == 2  # a dip below starts it over


def test_lengths_draw_each_step_s_sequences_the_same_way_for_a_seed(capsys):
    runs = [steps_of(capsys, "--steps", "12", "--lengths", "8:0.5,64:0.5", "--seed", "7") for _ in range(2)]
    lengths = [s["length"] for s in runs[0]]
    assert set(lengths) == {8, 64} and lengths == [s["length"] for s in runs[1]]
    assert "length" not in steps_of(capsys, "--steps", "1")[0]  # a job without --lengths says nothing of them


@pytest.mark.parametrize("bad", ["8", "8:x", "0:1", "8:0", "65:1"])
def test_bad_lengths_are_refused_before_the_job_starts(capsys, bad):
    with pytest.raises(SystemExit, match="--lengths"):
        trainjob().main(["--shape", "tiny", "--method", "fixed", "--batch", "4", "--lengths", bad])
    assert '"e": "start"' not in capsys.readouterr().out


def test_varlen_path_names_each_batch_with_the_lengths_it_ran():
    from bench.varlen import path

    assert path([[4, 64, 0], [4, 192, 0], [4, 128, 0], [16, 64, 0], [32, 128, 0], [32, 64, 0]]) == \
        "4 (64-192), 16 (64), 32 (64-128)"


def test_per_token_runs_as_many_sequences_as_the_budget_of_tokens_holds(capsys):
    steps = steps_of(capsys, "--steps", "8", "--lengths", "8:0.5,64:0.5", "--seed", "7", "--per-token",
                     "--batch", "100")
    assert {(s["length"], s["samples"]) for s in steps} == {(8, 12), (64, 1)}
    assert all(s["batch"] == 100 for s in steps)  # the budget, as memd gave it and is told it ran


def test_per_token_without_lengths_is_refused(capsys):
    with pytest.raises(SystemExit):
        trainjob().main(["--shape", "tiny", "--method", "fixed", "--batch", "4", "--per-token"])
    assert "--per-token needs --lengths" in capsys.readouterr().err


def _fixed_run(tmp_path, name, batch, steps, ended=True, workers=1):
    """A fixed run's reads and step events as bench/composition.py writes them."""
    run = tmp_path / name
    run.write_text(json.dumps({"t": 0.5, "workers": [{"private": 343}] * workers, "group": {"usage": 1900}}) + "\n")
    events = [{"e": "step", "i": i, "batch": batch, "dt": 2.5} for i in range(steps)]
    events += [{"e": "end"}] if ended else []
    (tmp_path / (name + ".steps")).write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(run)


def test_a_loader_is_judged_against_what_ran_as_long_beside_the_workers_it_chose(tmp_path):
    from bench import composition, realjobs

    results = tmp_path / "results.json"
    loader = {"method": "loader", "final_batch": 931, "settled_step": 0, "killed": False, "oom_errors": 0,
              "workers": [1, 1], "batches": [931, 931], "seconds": [1.0, 4.0]}
    results.write_text(json.dumps({"results": [{
        "row": {"name": "workers-2g", "limit_bytes": 2 << 30}, "feasible": {"batch": 129}, "runs": [loader],
        "workers_check": {"loader_workers": 1, "feasible_beside_chosen": {"batch": 988}}}]}))
    assert "94.2 % of the 988 that fit beside 1)" in realjobs.table(json.loads(results.read_text())["results"])

    killed = _fixed_run(tmp_path, "w1-980", 980, 41, ended=False)  # killed at step 41
    composition.record("workers-2g", [killed], str(results), beside=1)
    # below 980 is not yet a batch that ran: still judged against the short probes
    assert "94.2 % of the 988 that fit beside 1; below 980 in 41 steps)" in \
        realjobs.table(json.loads(results.read_text())["results"])

    runs = [_fixed_run(tmp_path, "w1-960-%d" % k, 960, 400) for k in range(3)] + [killed]
    composition.record("workers-2g", runs, str(results), beside=1)
    data = json.loads(results.read_text())
    assert data["results"][0]["workers_check"]["feasible_beside_chosen"]["long"]["batch"] == 960
    assert "long" not in data["results"][0]["feasible"]  # the row's own feasible untouched
    assert "97.0 % of the 960 that fit beside 1 in 400 steps)" in realjobs.table(data["results"])

    with pytest.raises(SystemExit, match="ran 2 workers, not 1"):
        composition.record("workers-2g", [_fixed_run(tmp_path, "w2", 900, 400, workers=2)], str(results), beside=1)


def test_the_loader_at_a_fixed_plan_runs_its_batch_beside_its_workers_with_no_daemon(capsys):
    """The probe a loader's batch is judged against: MemdLoader itself, its plan fixed (a plan
    from a session would say source "daemon" or "fallback")."""
    trainjob().main(["--shape", "workers", "--method", "loader", "--batch", "6", "--workers", "1", "--prefetch", "1",
                     "--steps", "3"])
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"e": "step"')]
    assert [(s["batch"], s["workers"], s["source"]) for s in steps] == [(6, 1, "fixed")] * 3


def test_a_gpu_run_is_refused_where_torch_sees_no_gpu(capsys):
    job = trainjob()
    if job.torch.cuda.is_available():
        pytest.skip("a GPU is here: bench/gpujobs.py runs it")
    with pytest.raises(SystemExit):
        job.main(["--shape", "gpt-gpu", "--method", "fixed", "--batch", "4", "--device", "cuda"])
    assert "sees no CUDA device" in capsys.readouterr().err
    from bench import gpujobs

    assert gpujobs.main(["--out", "/nonexistent/gpujobs"]) == 2  # before any tenant, daemon or file
    assert "sees no CUDA device" in capsys.readouterr().err


def test_a_gpu_job_an_out_of_memory_error_ended_counts_as_an_error_not_a_kill():
    from bench import realjobs

    ended = {"method": "suggest", "final_batch": None, "settled_step": None, "killed": False, "oom_ended": True,
             "oom_errors": 0, "last_try": 112, "batches": [4, 16, 64], "seconds": [1.0, 2.0, 3.0]}
    caught = {"method": "accelerate", "final_batch": 64, "settled_step": 0, "killed": False, "oom_errors": 1,
              "batches": [64, 64], "seconds": [5.0, 6.0]}
    row = {"name": "gpt-gpu-16g", "limit_bytes": 16 << 30, "device": "cuda"}
    text = realjobs.table([{"row": row, "feasible": {"batch": 90}, "runs": [ended, caught]}])
    assert "| suggest | out of memory at 112 | 0 % | 1 | 0 |" in text
    assert "| accelerate | 64 | 71.1 % | 1 | 0 |" in text
    assert realjobs.pool_words(row) == "the 16.00 GiB another tenant leaves on its GPU"


def test_a_step_a_finder_began_and_never_ended_was_an_out_of_memory_error_it_caught():
    """accelerate's events on the H200 (bench/gpujobs.py): a trial at 128 whose first step never
    ended, then 115, then a run at 103; a caught error the loop reported; Lightning's search
    steps, which end in "trial"."""
    from bench.realjobs import Run, read_events

    events = [{"e": "trial", "batch": 128}, {"e": "try", "batch": 128},
              {"e": "trial", "batch": 115}, {"e": "try", "batch": 115},
              {"e": "trial", "batch": 103}] + [
              e for i in range(2) for e in ({"e": "try", "batch": 103},
                                            {"e": "step", "i": i, "batch": 103, "t": i, "hwm": 1})]
    run = Run("accelerate")
    read_events(run, [json.dumps(e) for e in events] + ["not json"])
    assert (run.oom_errors, run.trials, run.batches) == (2, [128, 115, 103], [103, 103])

    helpers = Run("helpers")
    read_events(helpers, [json.dumps(e) for e in ({"e": "try", "batch": 90}, {"e": "oom", "batch": 90},
                                                  {"e": "try", "batch": 67},
                                                  {"e": "step", "i": 0, "batch": 67, "t": 1, "hwm": 1})])
    assert helpers.oom_errors == 1  # reported once, not counted again when the next step begins

    lightning = Run("lightning-power")
    search = [{"e": "try", "batch": 64}, {"e": "trial", "i": 0, "batch": 64, "dt": 0.2}, {"e": "try", "batch": 128},
              {"e": "try", "batch": 64}, {"e": "step", "i": 0, "batch": 64, "t": 3, "hwm": 1}]
    read_events(lightning, [json.dumps(e) for e in search])
    assert (lightning.oom_errors, lightning.trials) == (1, [64])

    died = Run("suggest")
    read_events(died, [json.dumps(e) for e in ({"e": "try", "batch": 90}, {"e": "died", "error": "out of memory"})])
    assert (died.oom_errors, died.oom_ended, died.last_try) == (0, True, 90)

"""memd.client.training against the real daemon: ranks of a real gloo job agree on one plan; a
step reports its peak, and an out-of-memory error becomes a smaller plan instead of a crash."""
import json
import os
import subprocess
import sys

import pytest

from memd import client
from realdaemon import memd_env, wait_for

torch = pytest.importorskip("torch")
from memd.client import training  # noqa: E402  (after the skip: the helpers are for torch users)

HERE = os.path.dirname(os.path.abspath(__file__))


def run_ranks(tmp_path, endpoint, max_batches, target):
    init_file = str(tmp_path / "dist-init")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "ddp_rank.py"), init_file, str(rank),
                               str(len(max_batches)), endpoint, str(limit), str(target) if target else "-"],
                              env=memd_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, limit in enumerate(max_batches)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_ranks_agree_on_the_smallest_batch_and_keep_the_effective_batch(memd, tmp_path):
    ranks = run_ranks(tmp_path, memd.endpoint, [8, 4, 16], target=32)
    assert [r["own"]["batch_size"] for r in ranks] == [8, 4, 16]  # what each rank was told alone
    for r in ranks:
        agreed = r["agreed"]
        assert (agreed["batch_size"], agreed["grad_accum_steps"], agreed["effective_batch_size"]) == (4, 8, 32)
    assert "3 ranks agreed on batch 4" in ranks[0]["agreed"]["reason"]
    assert ranks[1]["agreed"]["reason"] == ranks[1]["own"]["reason"]  # the smallest rank's plan is unchanged


def test_without_a_process_group_the_plan_is_unchanged():
    plan = client.Plan(batch_size=6, grad_accum_steps=1, effective_batch_size=6, num_workers=2,
                       prefetch_factor=2, throttle=False, pressure="ok", reason="r", source="daemon")
    assert training.agree(plan) is plan


def test_guarded_step_reports_and_turns_an_oom_into_a_smaller_plan(memd):
    with client.Session("guarded", endpoint=memd.endpoint, timeout=1.0, default_batch=16) as s:
        assert s.plan().batch_size == 16
        with training.guarded_step(s, 16) as outcome:
            torch.ones(1024, 1024).sum()  # a CPU step: the daemon measures the process itself
        assert outcome.oom is False
        view = lambda: next(v for v in memd.call("status")["sessions"] if v["job"] == "guarded")  # noqa: E731
        assert wait_for(lambda: view()["reports"] == 1)
        assert view()["latest_peak_bytes"] > 0

        # No GPU here: the CUDA OOM is raised by hand, as torch raises it from a failed allocation.
        with training.guarded_step(s, 16) as outcome:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        assert outcome.oom is True
        assert view()["ooms"] == 1
        assert s.plan().batch_size <= 12

        with pytest.raises(ValueError):  # anything but an OOM propagates
            with training.guarded_step(s, 12):
                raise ValueError("a bug in the step")


@pytest.mark.parametrize("exc, expected", [
    (torch.cuda.OutOfMemoryError("CUDA out of memory"), True),
    (RuntimeError("MPS backend out of memory"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:114] DefaultCPUAllocator: can't allocate memory"), True),
    (MemoryError(), True),
    (RuntimeError("shape mismatch"), False),
    (ValueError("out of memory"), False),
])
def test_is_oom(exc, expected):
    assert training.is_oom(exc) is expected


def test_a_hugging_face_trainer_takes_its_batch_from_the_plan_and_reports_each_step(memd, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer needs it
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                 n_positions=32))

    class Tokens(torch.utils.data.Dataset):  # made here: nothing is fetched from a hub
        def __len__(self):
            return 256

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    with client.Session("hf", endpoint=memd.endpoint, timeout=1.0, target_effective_batch=12, max_batch=4) as s:
        plan = s.plan()
        kwargs = training.trainer_arguments(plan)
        assert (kwargs["per_device_train_batch_size"], kwargs["gradient_accumulation_steps"]) == (4, 3)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, report_to=[],
                                              use_cpu=True, save_strategy="no", logging_strategy="no",
                                              disable_tqdm=True, **kwargs)
        transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                             callbacks=[training.trainer_callback(s)]).train()
        view = lambda: next(v for v in memd.call("status")["sessions"] if v["job"] == "hf")  # noqa: E731
        assert wait_for(lambda: view()["reports"] == 3)  # one per optimizer step (3 micro-batches each)
        assert view()["latest_batch"] == 4 and view()["latest_peak_bytes"] > 0  # measured by the daemon


def test_a_lightning_trainer_reports_each_batch(memd, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    with client.Session("lightning", endpoint=memd.endpoint, timeout=1.0, default_batch=8) as s:
        loader = torch.utils.data.DataLoader(data, batch_size=s.plan().batch_size)
        trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                             callbacks=[training.lightning_callback(s)])
        trainer.fit(Tiny(), loader)
        view = lambda: next(v for v in memd.call("status")["sessions"] if v["job"] == "lightning")  # noqa: E731
        assert wait_for(lambda: view()["reports"] == 4)
        assert view()["latest_batch"] == 8 and view()["latest_peak_bytes"] > 0


def test_batch_size_is_found_in_nested_batches():
    assert training._batch_size({"input_ids": torch.zeros(6, 3), "labels": torch.zeros(6)}) == 6
    assert training._batch_size([torch.zeros(5, 2), torch.zeros(5)]) == 5
    assert training._batch_size(("text only",)) is None

"""MemdCallback and MemdLightningCallback: real Trainers (tiny models built here, nothing
downloaded) against the real daemon. No GPU here: the out-of-memory errors are raised by hand
inside real steps, as torch raises them from a failed allocation (same type and message), at a
chosen batch; everything around them (the Trainers, their batch finders, the daemon) is real."""
import json
import os
import subprocess
import sys

import pytest

from memd import client
from realdaemon import memd_env, run_memd, wait_for

torch = pytest.importorskip("torch")
from memd.client import training  # noqa: E402  (after the skip: the callbacks are for torch users)

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB total capacity)"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class OOMInBackward(torch.autograd.Function):
    """Identity; its backward runs out of memory when the batch has more than ``limit`` rows."""

    @staticmethod
    def forward(ctx, x, limit):
        ctx.rows, ctx.limit = x.shape[0], limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.limit is not None and ctx.rows > ctx.limit:
            raise torch.OutOfMemoryError(OOM)
        return grad, None


class Regressor(torch.nn.Module):
    """A plain nn.Module the HF Trainer can train: forward(x, labels) -> {"loss": ...}."""

    def __init__(self, limit=None):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.limit = limit
        self.seen = []  # the batch of every forward

    def forward(self, x, labels=None):
        self.seen.append(x.shape[0])
        out = OOMInBackward.apply(self.layer(x), self.limit).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels)}


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 512

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.randn((), generator=g)}


def hf_args(tmp_path, **kwargs):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer needs it
    return transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True,
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True, **kwargs)


def view(memd, job):
    return next((v for v in memd.call("status")["sessions"] if v["job"] == job), None)


def curve(memd, job):
    done = run_memd(["curves", "--json", "--endpoint", memd.endpoint])
    assert done.returncode == 0, done.stderr
    return next((c for c in json.loads(done.stdout) if c["job"] == job), None)


def test_importing_training_loads_no_framework():
    code = ("import sys, memd.client.training as t; frameworks = ('torch', 'transformers', 'lightning', "
            "'pytorch_lightning'); print(sorted(m for m in frameworks if m in sys.modules)); "
            "print('MemdCallback' in t.__all__, 'MemdLightningCallback' in t.__all__)")
    done = subprocess.run([sys.executable, "-c", code], env=memd_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "False False"]


def test_the_classes_are_the_frameworks_callbacks(memd):
    transformers = pytest.importorskip("transformers")
    pl = pytest.importorskip("pytorch_lightning")
    from memd.client.training import MemdCallback, MemdLightningCallback
    assert issubclass(MemdCallback, transformers.TrainerCallback)
    assert issubclass(MemdLightningCallback, pl.Callback)
    with client.Session("mine", endpoint=memd.endpoint) as s:
        assert type(training.trainer_callback(s)) is MemdCallback and training.trainer_callback(s).session is s
        assert type(training.lightning_callback(s)) is MemdLightningCallback
        with pytest.raises(TypeError, match="not both"):
            MemdCallback(s, job="other")
    with pytest.raises(AttributeError):
        training.NoSuchCallback  # noqa: B018


def test_hf_auto_find_batch_size_reports_each_retry_as_an_oom_and_steps_at_the_batch_it_settled_on(memd, tmp_path):
    """The plan's 16 runs out of memory in backward; auto_find_batch_size retries at 14 (also
    too big), then 12, which fits: two OOMs, at 16 and 14, and every step at 12, not 16."""
    transformers = pytest.importorskip("transformers")
    model = Regressor(limit=12)
    with client.Session("hf-auto", endpoint=memd.endpoint, timeout=1.0, default_batch=16, num_workers=0) as s:
        memd_cb = training.MemdCallback(s)
        assert memd_cb.trainer_arguments()["per_device_train_batch_size"] == 16
        args = hf_args(tmp_path, max_steps=3, auto_find_batch_size=True, **memd_cb.trainer_arguments())
        transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[memd_cb]).train()
        assert model.seen == [16, 14, 12, 12, 12]  # what the Trainer really ran
        assert wait_for(lambda: view(memd, "hf-auto")["reports"] == 3)  # the caller's session: still open
        seen = view(memd, "hf-auto")
        assert seen["ooms"] == 2 and seen["latest_batch"] == 12
        assert s.plan().batch_size <= 10  # 3/4 of the last batch that ran out of memory (14)


def test_hf_an_oom_outside_the_step_is_reported_at_the_retry_and_the_next_run_plans_smaller(memd, tmp_path):
    """The collator runs out of memory above 12 rows: outside the forward, backward and optimizer
    step, so only auto_find_batch_size's retry tells. The callback's own session is closed when
    training ends, and what it learned is the next run's: a ceiling below 16, a plan below 16."""
    transformers = pytest.importorskip("transformers")

    def collate(features):
        if len(features) > 12:
            raise torch.OutOfMemoryError(OOM)
        return transformers.default_data_collator(features)

    memd_cb = training.MemdCallback(job="hf-collate", endpoint=memd.endpoint, timeout=1.0, default_batch=16,
                                    num_workers=0)  # the collator in this process: no worker to shut down
    args = hf_args(tmp_path, max_steps=2, auto_find_batch_size=True, **memd_cb.trainer_arguments())
    transformers.Trainer(model=Regressor(), args=args, train_dataset=Rows(), data_collator=collate,
                         callbacks=[memd_cb]).train()
    assert wait_for(lambda: view(memd, "hf-collate") is None)  # closed at train end
    learned = curve(memd, "hf-collate")
    assert learned is not None and learned["ceiling"] is not None and learned["ceiling"] < 14
    with client.Session("hf-collate", endpoint=memd.endpoint, timeout=1.0, default_batch=16, num_workers=0) as again:
        assert again.plan().batch_size <= learned["ceiling"]


@pytest.mark.parametrize("where", ["backward", "optimizer step"])
def test_hf_an_oom_in_a_step_is_reported_before_it_leaves_train(memd, tmp_path, where):
    """Without auto_find_batch_size nothing catches the error: it leaves train() (and then the
    process), and memd has heard of it first, with the session closed: the next run plans below."""
    transformers = pytest.importorskip("transformers")
    model = Regressor(limit=8 if where == "backward" else None)

    class Adamish(torch.optim.SGD):  # its first step's state does not fit above 8 rows
        def step(self, closure=None):
            if model.seen[-1] > 8:
                raise torch.OutOfMemoryError(OOM)
            return super().step(closure)

    job = "hf-" + where.replace(" ", "-")
    memd_cb = training.MemdCallback(job=job, endpoint=memd.endpoint, timeout=1.0, default_batch=16, num_workers=0)
    args = hf_args(tmp_path, max_steps=2, **memd_cb.trainer_arguments())
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[memd_cb],
                                   optimizers=(Adamish(model.parameters(), lr=0.01), None))
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    assert model.seen == [16]
    assert view(memd, job) is None  # reported, then the session closed, before train() raised
    learned = curve(memd, job)
    assert learned is not None and learned["ceiling"] is not None and learned["ceiling"] < 16


def test_hf_any_other_error_leaves_train_with_the_session_closed_and_no_oom(memd, tmp_path):
    transformers = pytest.importorskip("transformers")

    class Broken(Regressor):
        def forward(self, x, labels=None):
            raise ValueError("a bug in the model")

    memd_cb = training.MemdCallback(job="hf-bug", endpoint=memd.endpoint, timeout=1.0, default_batch=4, num_workers=0)
    args = hf_args(tmp_path, max_steps=2, **memd_cb.trainer_arguments())
    assert view(memd, "hf-bug") is not None
    with pytest.raises(ValueError, match="a bug"):
        transformers.Trainer(model=Broken(), args=args, train_dataset=Rows(), callbacks=[memd_cb]).train()
    assert view(memd, "hf-bug") is None  # bye: the daemon need not wait for the process to end
    assert curve(memd, "hf-bug") is None  # nothing learned: no step, no OOM


def test_hf_reports_reach_a_daemon_restarted_mid_run(memd, tmp_path):
    """The daemon restarts after step 2 (a systemd restart, an upgrade): the callback's session
    registers again by itself and the steps after it are reported to the new daemon. It retries
    within its backoff (2 s at most) once the new daemon answers: on a loaded machine the 7 steps
    of 0.1 s that followed the restart in an earlier form of this test ended before it had."""
    transformers = pytest.importorskip("transformers")
    import time

    class Restart(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                memd.stop()
                memd.start()
            time.sleep(0.1)  # steps of 0.1 s: the plan (fresh for 0.2 s here) is asked for again

    memd_cb = training.MemdCallback(job="hf-restart", endpoint=memd.endpoint, timeout=1.0, default_batch=4,
                                    num_workers=0)
    args = hf_args(tmp_path, max_steps=40, **memd_cb.trainer_arguments())
    trainer = transformers.Trainer(model=Regressor(), args=args, train_dataset=Rows(), callbacks=[Restart()])
    trainer.add_callback(memd_cb)  # after Restart: its step-2 report goes to the new daemon, and is refused
    seen = []
    trainer.add_callback(type("Look", (transformers.TrainerCallback,), {
        "on_step_end": lambda self, a, state, c, **k: seen.append(view(memd, "hf-restart")) if state.global_step == 39
        else None}))
    trainer.train()
    assert seen[0] is not None and seen[0]["reports"] >= 3, seen  # of the 37 steps after the restart
    assert seen[0]["latest_batch"] == 4


CYCLE = """
import gc, sys, time
from memd import client
s = client.Session("cycle", endpoint={endpoint!r}, timeout=1.0)
assert s.plan().source == "daemon"
loop = [s]
loop.append(loop)  # as a Trainer holds its callback and the callback its session
del s, loop
gc.collect()
print("collected")
"""


def test_a_session_dropped_unclosed_in_a_reference_cycle_does_not_hang_gc(memd):
    """gc ran pyzmq's Context.__del__ with the socket still open, and zmq_ctx_term waited forever."""
    done = subprocess.run([sys.executable, "-c", CYCLE.format(endpoint=memd.endpoint)], env=memd_env(),
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "collected"), done.stderr


class LitRegressor:
    """A LightningModule (made in a function: pytorch_lightning is imported only when present)."""

    @staticmethod
    def make(pl, limit=None, batch_size=None):
        class Lit(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(8, 1)
                self.batch_size = batch_size  # BatchSizeFinder's knob
                self.seen = []

            def training_step(self, batch, batch_idx):
                x, y = batch
                self.seen.append(x.shape[0])
                if limit is not None and x.shape[0] > limit:
                    raise torch.OutOfMemoryError(OOM)
                return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

            def train_dataloader(self):
                return loader(self.batch_size)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        return Lit()


def loader(batch_size):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def lightning_trainer(pl, tmp_path, callbacks, max_steps=3):
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                      callbacks=callbacks)


def test_lightning_reports_an_oom_through_on_exception_and_the_next_run_plans_smaller(memd, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    memd_cb = training.MemdLightningCallback(job="lit-oom", endpoint=memd.endpoint, timeout=1.0, default_batch=16)
    batch = memd_cb.plan().batch_size
    assert batch == 16
    model = LitRegressor.make(pl, limit=8)
    with pytest.raises(torch.OutOfMemoryError):
        lightning_trainer(pl, tmp_path, [memd_cb]).fit(model, loader(batch))
    assert model.seen == [16]
    assert view(memd, "lit-oom") is None  # reported and closed before fit() raised
    learned = curve(memd, "lit-oom")
    assert learned is not None and learned["ceiling"] is not None and learned["ceiling"] < 16
    with client.Session("lit-oom", endpoint=memd.endpoint, timeout=1.0, default_batch=16) as again:
        assert again.plan().batch_size <= learned["ceiling"]


def test_lightning_batch_size_finder_picks_the_batch_and_memd_sees_the_training_at_it(memd, tmp_path):
    """BatchSizeFinder's trials (2, 4, 8 fit; 16 runs out of memory) run with the callbacks
    detached: memd sees no OOM from them, then every training batch at the 8 it chose."""
    pl = pytest.importorskip("pytorch_lightning")
    model = LitRegressor.make(pl, limit=8, batch_size=2)
    finder = pl.callbacks.BatchSizeFinder(mode="power", init_val=2, steps_per_trial=1, max_trials=6)
    with client.Session("lit-finder", endpoint=memd.endpoint, timeout=1.0, default_batch=32) as s:
        lightning_trainer(pl, tmp_path, [finder, training.MemdLightningCallback(s)]).fit(model)
        assert model.seen[-3:] == [8, 8, 8] and 16 in model.seen
        assert wait_for(lambda: view(memd, "lit-finder")["reports"] == 3)
        seen = view(memd, "lit-finder")
        assert seen["ooms"] == 0 and seen["latest_batch"] == 8


DIES = """
import sys, torch, pytorch_lightning as pl
sys.path.insert(0, {tests!r})
from test_training_callbacks import LitRegressor, loader, lightning_trainer
from memd.client.training import MemdLightningCallback
memd = MemdLightningCallback(job="lit-dies", endpoint={endpoint!r}, timeout=1.0, default_batch=16)
lightning_trainer(pl, {tmp!r}, [memd]).fit(LitRegressor.make(pl, limit=8), loader(memd.plan().batch_size))
"""


def test_a_lightning_job_that_dies_of_an_oom_has_told_memd_first(memd, tmp_path):
    pytest.importorskip("pytorch_lightning")
    script = DIES.format(tests=os.path.join(ROOT, "tests"), endpoint=memd.endpoint, tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=memd_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "OutOfMemoryError" in done.stderr.splitlines()[-1], done.stderr[-2000:]
    learned = curve(memd, "lit-dies")
    assert learned is not None and learned["ceiling"] is not None and learned["ceiling"] < 16

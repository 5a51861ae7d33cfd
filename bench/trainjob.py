"""One real PyTorch training job on the CPU, taking its batch size the way a user would.

    python bench/trainjob.py --shape gpt --method suggest --steps 30 [--default-batch 4]

Shapes (real models, real AdamW/SparseAdam steps, synthetic data):
  gpt    a GPT-style decoder (tied embeddings, causal SDPA attention), vocab 4096, 256 tokens
  cnn    a small CNN (conv, batch norm, ReLU) on 64x64 RGB image tensors
  embed  a recommender: a 6M x 64 embedding table (SparseAdam) pooled over 256 ids a sample
  workers  the cnn (2 channels) fed by --workers DataLoader workers (persistent) from a dataset
         kept as Python objects: 1,200 records of 8,192 floats (300 MB); reading a record writes
         its objects' reference counts, so each forked worker grows toward a copy of it (seed
         004) within a few batches. An epoch draws 8 passes of the records with replacement
         (repeated augmentation), so every worker serves batches at any batch size: a worker
         that never gets one (a loader restarts its round-robin at worker 0 each epoch) copies
         nothing
  tiny   the gpt layout at a tenth of the cost, for the test suite
  gpt-gpu  the gpt layout at GPU scale (vocab 8192, 512 tokens, 8 layers of width 512), for
         --device cuda
  With --lengths L:P,... (gpt, tiny) each step's sequences are L tokens long, drawn with
  probability P (--seed): length-bucketed batches, as a sampler grouping by length makes them,
  so one batch size peaks differently from step to step (bench/varlen.py); with --per-token too,
  the batch a method gives is a budget of tokens, and each step runs budget // length sequences
Methods (where the batch size comes from):
  fixed                --batch N, every step (--steady-heap: glibc's heap held as memd's client holds it;
                       --switch-from B --switch-after N: B for the first N steps, then a rebuilt loader;
                       --with-session: asking memd for a plan and reporting each step, the batch fixed;
                       --prefetch P --freeze: the plain loader at a prefetch of P, its objects frozen
                       before the fork as MemdLoader freezes them)
  report               memd: Session.plan() (trim_heap() when its batch changes, as the README
                       shows), then report(batch, peak_bytes=VmHWM) and reset VmHWM
  suggest              memd: client.suggest_batch(default) alone, once a step
  helpers              memd: agreed_plan + guarded_step from memd.client.training (memd measures)
  loader               memd: MemdLoader (--shape workers): batch, workers and prefetch from the
                       plan, Session(num_workers=--workers); each batch reports the step before
                       (with --batch: that batch, --workers at --prefetch, no daemon: a probe)
  accelerate           accelerate's find_executable_batch_size (starting at 128, its default)
  lightning-power      Lightning's BatchSizeFinder, mode "power"
  lightning-binsearch  Lightning's BatchSizeFinder, mode "binsearch"

With --device cuda the model and its samples live on the GPU, and a step's peak (``hwm`` below,
and the report method's peak_bytes) is what PyTorch's allocator reserved at most
(torch.cuda.max_memory_reserved(), as README's report shows). An out-of-memory error no method
caught ends the job with {"e": "died", "error": "out of memory"} and exit status 3.

Every step prints {"e": "try", "batch"} before it starts and, once done, one JSON line
{"e": "step", "i", "batch", "dt", "t", "hwm", "source", "reason"} (``hwm``: the process's resident
high-water mark during the step, in bytes; ``t``: seconds since the job started, imports
included). A finder's search steps print "trial" instead of "step"; a caught out-of-memory error
prints {"e": "oom", "batch"}. A job the kernel kills prints nothing more: its last "try" says
where it died.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

T0 = time.monotonic()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "client")]

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.examjob import FixedPlan  # noqa: E402  (a plan that never moves: the loader's probe)

DEVICE = "cpu"  # --device
METHODS = ("fixed", "report", "suggest", "helpers", "loader", "accelerate", "lightning-power", "lightning-binsearch")


def emit(**fields) -> None:
    fields.setdefault("t", round(time.monotonic() - T0, 3))
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def vm_hwm() -> int:
    return status_bytes("VmHWM:")


def status_bytes(key: str) -> int:
    """A line of /proc/self/status ("VmHWM:", "RssAnon:"), in bytes; 0 where it has none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak() -> int:
    """A step's peak: on the GPU what PyTorch's allocator reserved at most, else VmHWM."""
    return int(torch.cuda.max_memory_reserved()) if DEVICE == "cuda" else vm_hwm()


def reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_hwm()


# -- shapes -------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int):
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens):
        h = self.tok(tokens[:, :-1]) + self.pos(torch.arange(tokens.shape[1] - 1, device=tokens.device))
        logits = self.head(self.ln(self.blocks(h)))
        return F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


class CNN(nn.Module):
    def __init__(self, width: int, classes: int = 100, channels: int = 3):
        super().__init__()

        def block(i, o):
            return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]

        w = width
        self.net = nn.Sequential(*block(channels, w), *block(w, w), nn.MaxPool2d(2), *block(w, 2 * w), *block(2 * w, 2 * w),
                                 nn.MaxPool2d(2), *block(2 * w, 4 * w), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(4 * w, classes))

    def forward(self, batch):
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)


class Recommender(nn.Module):
    def __init__(self, rows: int, d: int):
        super().__init__()
        self.table = nn.Embedding(rows, d, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(d, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, batch):
        ids, clicks = batch
        return F.binary_cross_entropy_with_logits(self.mlp(self.table(ids).mean(1)).squeeze(1), clicks)


PASSES = 8  # passes over the records per epoch (the workers shape)


def passes(records) -> torch.utils.data.Sampler:
    return torch.utils.data.RandomSampler(records, replacement=True, num_samples=PASSES * len(records))


class Records(torch.utils.data.Dataset):
    """Images kept as Python lists of floats, normalised in Python when read (a common first
    dataset): every read writes the reference counts of a record's 8,192 float objects."""

    def __init__(self, count: int = 1200, floats: int = 8192):
        self.rows = [[float((i * 7919 + j) % 256) for j in range(floats)] for i in range(count)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return torch.tensor([v / 255.0 for v in self.rows[i]]).view(2, 64, 64), i % 100


class Shape:
    """A model, its optimizers, and one synthetic sample (or a whole batch of them)."""

    def __init__(self, name: str, workers: int = 2, lengths=(), seed: int = 0, per_token: bool = False,
                 prefetch=None, freeze: bool = False):
        self.name = name
        self.workers, self.prefetch, self.freeze = workers, prefetch, freeze
        self.loader = None
        self.lengths, self.length, self.draw = list(lengths), None, random.Random(seed)
        self.per_token = per_token
        torch.manual_seed(0)
        if name in ("gpt", "tiny", "gpt-gpu"):
            vocab, seq, d, heads, layers = {"gpt": (4096, 257, 128, 4, 2), "tiny": (512, 65, 64, 4, 1),
                                            "gpt-gpu": (8192, 513, 512, 8, 8)}[name]
            if any(length > seq - 1 for length, _ in self.lengths):
                raise SystemExit("--lengths: at most %d tokens for --shape %s" % (seq - 1, name))
            self.model = GPT(vocab, seq - 1, d, heads, layers)
            self.sample = lambda n: torch.randint(0, vocab, (n, (self.length or seq - 1) + 1), device=DEVICE)
        elif self.lengths:
            raise SystemExit("--lengths is for --shape gpt or tiny")
        elif name == "cnn":
            self.model = CNN(8)
            self.sample = lambda n: (torch.randn(n, 3, 64, 64, device=DEVICE), torch.randint(0, 100, (n,), device=DEVICE))
        elif name == "embed":
            rows, d, ids = 6_000_000, 64, 256
            self.model = Recommender(rows, d)
            self.sample = lambda n: (torch.randint(0, rows, (n, ids)), torch.rand(n))
        elif name == "workers":
            self.model = CNN(8, channels=2)
            self.records = Records()
            self.sample = self._from_loader
        else:
            raise SystemExit("unknown shape %r" % name)
        self.model.to(DEVICE)
        if name == "embed":
            self.optimizers = [torch.optim.SparseAdam(list(self.model.table.parameters()), lr=1e-3),
                               torch.optim.AdamW(self.model.mlp.parameters(), lr=1e-3)]
        else:
            self.optimizers = [torch.optim.AdamW(self.model.parameters(), lr=1e-4)]

    def next_length(self, batch: int) -> dict:
        """Draw the next step's sequence length (--lengths), as fields for its events: the length,
        and with --per-token the sequences a step of ``batch`` runs."""
        if not self.lengths:
            return {}
        self.length = self.draw.choices([n for n, _ in self.lengths], [p for _, p in self.lengths])[0]
        return {"length": self.length, "samples": self.samples(batch)} if self.per_token else {"length": self.length}

    def samples(self, batch: int) -> int:
        """The sequences a step of ``batch`` runs: ``batch`` itself, or with --per-token, as many
        of this step's length as the budget of ``batch`` tokens holds (one at least)."""
        return max(1, batch // self.length) if self.per_token else batch

    def step(self, batch_size: int, accum: int = 1) -> float:
        for _ in range(accum):
            loss = self.model(self.sample(batch_size)) / accum
            loss.backward()
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def _from_loader(self, n: int):
        """The next batch of ``n`` from a DataLoader over the records, rebuilt when ``n``
        changes (as a training loop following a plan rebuilds it)."""
        if self.loader is None or self.loader.batch_size != n:
            if self.freeze:  # as MemdLoader does before forking: no collection then copies what they share
                gc.collect()
                gc.freeze()
            self.loader = torch.utils.data.DataLoader(self.records, batch_size=n, sampler=passes(self.records), drop_last=True,
                                                      num_workers=self.workers, persistent_workers=self.workers > 0,
                                                      prefetch_factor=self.prefetch if self.workers else None)
            self.batches = iter(self.loader)
        try:
            return next(self.batches)
        except StopIteration:  # the next epoch, from the same (persistent) workers
            self.batches = iter(self.loader)
            return next(self.batches)

    def dataset(self):
        """The same samples as a map-style Dataset, for the frameworks' own loaders."""
        if self.name == "workers":
            return self.records
        sample = self.sample

        class Synthetic(torch.utils.data.Dataset):
            def __len__(self):
                return 1 << 24

            def __getitem__(self, i):
                one = sample(1)
                return tuple(t[0] for t in one) if isinstance(one, tuple) else one[0]

        return Synthetic()


# -- methods ------------------------------------------------------------------------------------

def run_steps(shape: Shape, steps: int, batch_for, after=None) -> None:
    """``batch_for(i)`` -> (batch, accum, plan or None); ``after(i, batch, hwm)`` once a step is done."""
    for i in range(steps):
        batch, accum, plan = batch_for(i)
        length = shape.next_length(batch)
        emit(e="try", batch=batch, **length)
        started = time.monotonic()
        shape.step(shape.samples(batch), accum)
        hwm = peak()
        emit(e="step", i=i, batch=batch, accum=accum, dt=round(time.monotonic() - started, 3), hwm=hwm,
             source=getattr(plan, "source", None), reason=getattr(plan, "reason", None), **length)
        if after is not None:
            after(i, batch, hwm)


def method_fixed(shape: Shape, args) -> None:
    """--batch every step; with --switch-from B0 --switch-after N, B0 for the first N steps (a loop
    that started at its default and then moved, rebuilding its loader, as an adaptive method's does;
    its heap trimmed at the move, as memd's client trims at each change); with --schedule
    B0:N0,B1:N1,..., each batch for its steps in turn, then --batch (an adaptive method's path)."""
    schedule = parse_schedule(args.schedule) if args.schedule else \
        [(args.switch_from, args.switch_after)] if args.switch_from else []
    starts = [sum(n for _, n in schedule[:k]) for k in range(len(schedule) + 1)]

    def batch_for(i):
        at = next((k for k in range(len(schedule)) if i < starts[k + 1]), len(schedule))
        if schedule and i in starts[1:]:
            from memd.client.heap import trim_heap
            trim_heap()
        return (schedule[at][0] if at < len(schedule) else args.batch), 1, None

    if not args.with_session:
        run_steps(shape, args.steps, batch_for, lambda i, batch, hwm: reset_peak())
        return
    from memd import client

    with client.Session(job=args.job, default_batch=args.batch) as s:  # asked and told, its plans not taken
        def after(i, batch, hwm):
            s.plan()
            s.report(batch_size=batch, peak_bytes=hwm)
            reset_peak()
        run_steps(shape, args.steps, batch_for, after)


def parse_lengths(text: str):
    """'64:0.5,256:0.5' -> [(64, 0.5), (256, 0.5)]: sequence lengths and their probabilities."""
    try:
        lengths = [(int(n), float(p)) for n, p in (part.split(":") for part in text.split(","))]
    except ValueError:
        lengths = []
    if not lengths or any(n < 1 or not p > 0 for n, p in lengths):
        raise SystemExit("--lengths wants TOKENS:PROBABILITY,... (tokens at least 1, each probability > 0), not %r"
                         % text)
    return lengths


def parse_schedule(text: str):
    """'32:250,36:2' -> [(32, 250), (36, 2)]: batches and the steps each runs."""
    try:
        schedule = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    except ValueError:
        schedule = []
    if not schedule or any(len(p) != 2 or min(p) < 1 for p in schedule):
        raise SystemExit("--schedule wants BATCH:STEPS,BATCH:STEPS,... (each at least 1), not %r" % text)
    return schedule


def method_report(shape: Shape, args) -> None:
    from memd import client

    with client.Session(job=args.job, default_batch=args.default_batch) as s:
        last = {}

        def batch_for(i):
            plan = s.plan()
            if last.get("batch", plan.batch_size) != plan.batch_size:
                client.trim_heap()
            last["batch"] = plan.batch_size
            return plan.batch_size, plan.grad_accum_steps, plan

        def after(i, batch, hwm):
            s.report(batch_size=batch, peak_bytes=hwm)
            reset_peak()

        run_steps(shape, args.steps, batch_for, after)


def method_suggest(shape: Shape, args) -> None:
    from memd import client

    def batch_for(i):
        return client.suggest_batch(default=args.default_batch, job=args.job), 1, None

    run_steps(shape, args.steps, batch_for)


def method_helpers(shape: Shape, args) -> None:
    from memd import client
    from memd.client.training import agreed_plan, guarded_step

    with client.Session(job=args.job, default_batch=args.default_batch) as s:
        for i in range(args.steps):
            plan = agreed_plan(s)
            length = shape.next_length(plan.batch_size)
            emit(e="try", batch=plan.batch_size, **length)
            started = time.monotonic()
            with guarded_step(s, plan.batch_size) as outcome:
                shape.step(shape.samples(plan.batch_size), plan.grad_accum_steps)
            if outcome.oom:
                emit(e="oom", batch=plan.batch_size)
                continue
            emit(e="step", i=i, batch=plan.batch_size, accum=plan.grad_accum_steps,
                 dt=round(time.monotonic() - started, 3), hwm=peak(), source=plan.source, reason=plan.reason,
                 **length)


def method_loader(shape: Shape, args) -> None:
    from memd import client
    from memd.client.training import MemdLoader

    if shape.name != "workers":
        raise SystemExit("--method loader reads the workers shape's dataset")
    with (FixedPlan(args.batch, args.workers, args.prefetch or 2) if args.batch else
          client.Session(job=args.job, default_batch=args.default_batch, num_workers=args.workers)) as s:
        loader = MemdLoader(shape.records, s, sampler=passes(shape.records), drop_last=True, report=not args.batch)
        i = 0
        while i < args.steps:
            for batch in loader:
                plan = loader.plan
                emit(e="try", batch=plan.batch_size)
                started = time.monotonic()
                images, labels = batch
                loss = F.cross_entropy(shape.model.net(images), labels)
                loss.backward()
                for opt in shape.optimizers:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                emit(e="step", i=i, batch=len(labels), accum=1, dt=round(time.monotonic() - started, 3), hwm=peak(),
                     source=plan.source, reason=plan.reason, workers=plan.num_workers)
                i += 1
                if i >= args.steps:
                    break


def method_accelerate(shape: Shape, args) -> None:
    from accelerate.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=args.starting_batch)
    def train(batch_size):
        emit(e="trial", batch=batch_size)
        run_steps(shape, args.steps, lambda i: (batch_size, 1, None))

    train()


def method_lightning(shape: Shape, args, mode: str) -> None:
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    import logging

    for name in ("lightning.pytorch", "pytorch_lightning", "lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    phase = {"search": False, "i": 0}

    class Finder(pl.callbacks.BatchSizeFinder):
        def scale_batch_size(self, trainer, module):
            phase["search"] = True
            try:
                super().scale_batch_size(trainer, module)
            finally:
                phase["search"] = False
            emit(e="found", batch=self.optimal_batch_size)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = shape.model
            self.batch_size = 2  # the finder's init_val
            self.automatic_optimization = False  # the recommender steps two optimizers

        def training_step(self, batch, batch_idx):
            started = time.monotonic()
            emit(e="try", batch=len(batch[1]) if isinstance(batch, (list, tuple)) else len(batch))
            loss = self.net(batch)
            self.manual_backward(loss)
            optimizers = self.optimizers()
            for opt in optimizers if isinstance(optimizers, list) else [optimizers]:
                opt.step()
                opt.zero_grad(set_to_none=True)
            size = len(batch[1]) if isinstance(batch, (list, tuple)) else len(batch)
            emit(e="trial" if phase["search"] else "step", i=phase["i"], batch=size, accum=1,
                 dt=round(time.monotonic() - started, 3), hwm=peak(), source=None, reason=None)
            phase["i"] += 0 if phase["search"] else 1

        def configure_optimizers(self):
            return shape.optimizers

        def train_dataloader(self):
            return torch.utils.data.DataLoader(shape.dataset(), batch_size=self.batch_size, num_workers=shape.workers,
                                               persistent_workers=shape.workers > 0,
                                               sampler=passes(shape.records) if shape.name == "workers" else None)

    import tempfile

    with tempfile.TemporaryDirectory(prefix="memd-lightning-") as root:  # the finder writes a checkpoint there
        trainer = pl.Trainer(accelerator="gpu" if DEVICE == "cuda" else "cpu", devices=1, max_steps=args.steps,
                             callbacks=[Finder(mode=mode)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=root)
        trainer.fit(Module())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", required=True, choices=("gpt", "cnn", "embed", "workers", "tiny", "gpt-gpu"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model trains")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (--shape workers)")
    parser.add_argument("--method", required=True, choices=METHODS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, help="the batch for --method fixed, or --method loader's fixed plan")
    parser.add_argument("--switch-from", type=int, help="--method fixed: the batch of its first --switch-after steps")
    parser.add_argument("--switch-after", type=int, default=0)
    parser.add_argument("--schedule", help="--method fixed: BATCH:STEPS,... run in turn before --batch")
    parser.add_argument("--with-session", action="store_true",
                        help="--method fixed: also ask memd for a plan and report each step (MEMD_ENDPOINT), "
                             "the batch staying --batch: what memd's client adds to a job")
    parser.add_argument("--default-batch", type=int, default=4, help="the user's default for memd's methods")
    parser.add_argument("--starting-batch", type=int, default=128, help="accelerate's starting_batch_size")
    parser.add_argument("--job", default=None, help="memd job name (default: bench-SHAPE)")
    parser.add_argument("--steady-heap", action="store_true",
                        help="hold glibc's mmap threshold as memd's client does (memd.client.heap.steady_heap)")
    parser.add_argument("--prefetch", type=int, help="--shape workers: each worker's prefetch_factor (torch's 2 unset)")
    parser.add_argument("--freeze", action="store_true",
                        help="--shape workers: gc.collect() and gc.freeze() before forking workers, as MemdLoader does")
    parser.add_argument("--lengths", default="", metavar="L:P,...",
                        help="gpt, tiny: each step's sequence length, L tokens with probability P")
    parser.add_argument("--seed", type=int, default=0, help="the draw of --lengths")
    parser.add_argument("--per-token", action="store_true",
                        help="with --lengths: a method's batch is a budget of tokens, each step runs budget // length "
                             "sequences (memd asked for tokens, as a job of varying lengths should)")
    args = parser.parse_args(argv)
    lengths = parse_lengths(args.lengths) if args.lengths else []
    if args.steady_heap:
        from memd.client.heap import steady_heap
        steady_heap()
    args.job = args.job or "bench-%s" % args.shape
    if args.per_token and not lengths:
        parser.error("--per-token needs --lengths")
    if lengths and args.method not in ("fixed", "report", "suggest", "helpers"):
        parser.error("--lengths runs with --method fixed, report, suggest or helpers")
    if args.method == "fixed" and not args.batch:
        parser.error("--method fixed needs --batch")
    if args.schedule:
        if args.switch_from:
            parser.error("--schedule and --switch-from both set a path: give one")
        parse_schedule(args.schedule)  # a typo fails here, before the dataset is built
    if args.freeze and (args.shape != "workers" or args.method != "fixed"):
        parser.error("--freeze is for --shape workers --method fixed (MemdLoader freezes as it forks)")
    if args.prefetch and not (args.shape == "workers" and (args.method == "fixed" or args.method == "loader" and args.batch)):
        parser.error("--prefetch is for --shape workers, --method fixed or --method loader --batch "
                     "(a plan sets MemdLoader's)")
    if args.device == "cuda" and (args.shape in ("embed", "workers") or args.method == "loader"):
        parser.error("--device cuda trains the gpt, gpt-gpu, tiny or cnn shapes, not %s" % args.shape)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no CUDA device here")
    global DEVICE
    DEVICE = args.device
    shape = Shape(args.shape, args.workers if args.shape == "workers" else 0, lengths, args.seed, args.per_token,
                  args.prefetch, args.freeze)
    emit(e="start", pid=os.getpid(), params=sum(p.numel() for p in shape.model.parameters()), hwm=vm_hwm())
    try:
        if args.method.startswith("lightning-"):
            method_lightning(shape, args, args.method.split("-", 1)[1])
        else:
            globals()["method_" + args.method](shape, args)
    except torch.cuda.OutOfMemoryError:  # one no method caught: on a GPU the job ends here, not killed
        emit(e="died", error="out of memory")
        sys.exit(3)
    emit(e="end", hwm=vm_hwm())


if __name__ == "__main__":
    main()

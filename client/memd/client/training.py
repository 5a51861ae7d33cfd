"""PyTorch helpers for training loops: one plan for every rank, and a step that reports itself.

    from memd import client
    from memd.client.training import agreed_plan, guarded_step

    with client.Session(job="llama-ft", target_effective_batch=64) as s:
        for step in range(steps):
            plan = agreed_plan(s)              # every rank: the same batch size
            with guarded_step(s, plan.batch_size) as outcome:
                ...                            # forward, backward, optimizer step
            if outcome.oom:
                optimizer.zero_grad()          # the next plan is already smaller

With the Hugging Face Trainer, ``MemdCallback`` opens the job's session, gives the Trainer its
arguments and reports every optimizer step and every out-of-memory error (before the process
dies of it):

    from memd.client.training import MemdCallback

    memd = MemdCallback(job="llama-ft", target_effective_batch=64)   # or MemdCallback(session)
    args = TrainingArguments(output_dir=..., **memd.trainer_arguments())
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[memd]).train()

With Lightning, ``MemdLightningCallback`` does the same through ``on_exception``:

    memd = MemdLightningCallback(job="vit")
    loader = DataLoader(ds, batch_size=memd.plan().batch_size)
    Trainer(callbacks=[memd]).fit(model, loader)

A running Trainer's batch cannot change (its DataLoader is built when training starts): memd's
later plans apply when the job is next started, or restarted from a checkpoint, with arguments
taken from the plan again. Both coexist with the frameworks' own batch finders: under
``auto_find_batch_size`` the Trainer starts at the plan's batch and each of its retries is
reported as an out-of-memory error at the batch before it, then each step at the batch it
settled on; Lightning's ``BatchSizeFinder`` runs its trials with the callbacks detached, so memd
sees neither its trials nor their errors, only the training that follows at the batch it chose.
A ``session`` given is the caller's to close; one the callback opened is closed when training ends.

For a plain loop, ``MemdLoader(dataset, s)`` is a DataLoader that follows the plan: batch size,
workers, prefetch and throttle, rebuilt between batches without losing or repeating a sample.

Imported on demand only: ``import memd.client`` never loads torch. Nothing here imports torch,
transformers or lightning unless the caller does: the two callback classes are made when first
looked up (``from memd.client.training import MemdCallback``), and left out of ``import *``.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import replace
from typing import Any, Dict, Iterator, Optional

from . import Session
from .heap import trim_heap
from .loader import MemdLoader
from .plan import PRESSURE_LEVELS, Plan, split_batch

__all__ = ["agree", "agreed_plan", "guarded_step", "StepOutcome", "is_oom", "trainer_arguments", "trainer_callback",
           "lightning_callback", "MemdLoader"]

_NONE = 1 << 30  # stands for "no prefetch_factor" in the element-wise minimum
_last_batch: "weakref.WeakKeyDictionary[Session, int]" = weakref.WeakKeyDictionary()  # guarded_step's


def agreed_plan(session: Session, group: Any = None) -> Plan:
    """``session.plan()``, made the same on every rank of ``group`` (see ``agree``).

    A collective: every rank of the group must call it at the same point of the loop.
    """
    return agree(session.plan(), target_effective_batch=session.target_effective_batch,
                 min_batch=session.min_batch, group=group)


def agree(plan: Plan, *, target_effective_batch: Optional[int] = None, min_batch: int = 1,
          group: Any = None) -> Plan:
    """The plan all ranks can follow: the smallest batch, workers and prefetch any rank was
    given, the worst pressure, throttle if any rank must.

    Ranks of one data-parallel job must step with the same batch size, or gradients are
    averaged over unequal shards; the smallest plan fits everywhere. With a target effective
    batch every rank's batch divides it, so the smallest does too and the effective batch stays
    exact. Without torch.distributed initialised (or with one rank) the plan is returned as is.
    """
    dist = _distributed()
    if dist is None or dist.get_world_size(group) <= 1:
        return plan
    torch = sys.modules["torch"]
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":  # NCCL reduces only tensors on the rank's GPU
        device = torch.device("cuda", torch.cuda.current_device())
    mine = [plan.batch_size, plan.num_workers,
            plan.prefetch_factor if plan.prefetch_factor is not None else _NONE,
            -int(plan.throttle), -PRESSURE_LEVELS.index(plan.pressure)]
    values = torch.tensor(mine, dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    batch, workers, prefetch, throttle, level = (int(v) for v in values.tolist())
    if [batch, workers, prefetch, throttle, level] == mine:
        return plan
    batch, steps, note = split_batch(batch, target_effective_batch, min_batch)
    reason = plan.reason
    if batch != plan.batch_size:
        reason += "; the %d ranks agreed on batch %d (the smallest any was given)" % (dist.get_world_size(group), batch)
    return replace(
        plan, batch_size=batch, grad_accum_steps=steps, effective_batch_size=batch * steps,
        num_workers=workers, prefetch_factor=(2 if prefetch == _NONE else prefetch) if workers else None,
        throttle=bool(throttle), pressure=PRESSURE_LEVELS[-level], reason=reason + ("; " + note if note else ""))


class StepOutcome:
    """What ``guarded_step`` saw: ``oom`` is True when the step ran out of memory."""

    def __init__(self) -> None:
        self.oom = False
        self.peak_bytes: Optional[int] = None


@contextlib.contextmanager
def guarded_step(session: Session, batch_size: int, device: Any = None) -> Iterator[StepOutcome]:
    """Run one training step: report its peak memory, or turn an out-of-memory error into a
    smaller plan instead of a crash.

    On a CUDA device the peak is the caching allocator's reserved peak (what the device must
    hold); elsewhere it is left to the daemon, which measures the job's process tree. A step at
    a batch size other than the last guarded step's first gives back what the old batch left
    held (``trim_heap``: the C heap's free pages, PyTorch's cached CUDA blocks). An OOM is
    swallowed after ``report_oom`` (which waits for the daemon's smaller plan) and the cache is
    emptied; any other exception propagates. Under DDP an OOM on one rank leaves the others
    waiting in their collectives: there, stop the job rather than carry on.
    """
    outcome = StepOutcome()
    if _last_batch.get(session, batch_size) != batch_size:
        trim_heap()
    _last_batch[session] = batch_size
    cuda = _cuda(device)
    if cuda is not None:
        cuda.reset_peak_memory_stats(device)
    try:
        yield outcome
    except Exception as exc:
        if not is_oom(exc):
            raise
        outcome.oom = True
    if outcome.oom:
        if cuda is not None:
            cuda.empty_cache()  # the failed step's tensors were freed with its frames
        session.report_oom(batch_size)
        return
    if cuda is not None:
        outcome.peak_bytes = int(cuda.max_memory_reserved(device))
    session.report(batch_size, peak_bytes=outcome.peak_bytes)


def trainer_arguments(plan: Plan) -> Dict[str, Any]:
    """The plan as keyword arguments of transformers.TrainingArguments."""
    args: Dict[str, Any] = {"per_device_train_batch_size": plan.batch_size,
                            "gradient_accumulation_steps": plan.grad_accum_steps,
                            "dataloader_num_workers": plan.num_workers}
    if plan.num_workers and plan.prefetch_factor:
        args["dataloader_prefetch_factor"] = plan.prefetch_factor
    return args


def trainer_callback(session: Session, device: Any = None) -> Any:
    """``MemdCallback(session, device=device)``: the caller's session, which it keeps open."""
    from .callbacks import trainer_class
    return trainer_class()(session, device=device)


def lightning_callback(session: Session, device: Any = None) -> Any:
    """``MemdLightningCallback(session, device=device)``: the caller's session, which it keeps open."""
    from .callbacks import lightning_class
    return lightning_class()(session, device=device)


def __getattr__(name: str) -> Any:
    """MemdCallback and MemdLightningCallback, made at first look-up (importing their framework)."""
    if name == "MemdCallback":
        from .callbacks import trainer_class
        return trainer_class()
    if name == "MemdLightningCallback":
        from .callbacks import lightning_class
        return lightning_class()
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def _batch_size(batch: Any) -> Optional[int]:
    """The first dimension of the first tensor found in a batch (tensor, sequence or mapping)."""
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = _batch_size(item)
        if size:
            return size
    return None


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error from PyTorch (CUDA, MPS or the CPU allocator)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)) if k)
        if kinds and isinstance(exc, kinds):
            return True
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc))


def _distributed() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _cuda(device: Any) -> Any:
    """torch.cuda when the step runs on an initialised CUDA device, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    if device is not None and torch.device(device).type != "cuda":
        return None
    return torch.cuda

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

With the Hugging Face Trainer, the batch is fixed when the Trainer is built: take it from the
plan, and report every optimizer step so that the job's next run starts from its real curve:

    with client.Session(job="llama-ft", target_effective_batch=64) as s:
        args = TrainingArguments(output_dir=..., **trainer_arguments(s.plan()))
        Trainer(model=model, args=args, train_dataset=ds, callbacks=[trainer_callback(s)]).train()

With Lightning, build the DataLoader with ``plan.batch_size`` and pass
``callbacks=[lightning_callback(s)]`` to the Trainer.

For a plain loop, ``MemdLoader(dataset, s)`` is a DataLoader that follows the plan: batch size,
workers, prefetch and throttle, rebuilt between batches without losing or repeating a sample.

Imported on demand only: ``import memd.client`` never loads torch. Nothing here imports torch,
transformers or lightning unless the caller does.
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
    a batch size other than the last guarded step's first gives the C heap's free pages back to
    the kernel (``trim_heap``). An OOM is swallowed after ``report_oom`` (which waits for the
    daemon's smaller plan) and the cache is emptied; any other exception propagates. Under DDP
    an OOM on one rank leaves the others waiting in their collectives: there, stop the job
    rather than carry on.
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
    """A transformers.TrainerCallback that reports each optimizer step's peak to the session.

    The peak is the CUDA allocator's reserved peak over the step's micro-batches (each of
    ``per_device_train_batch_size``); on the CPU the daemon measures the process instead.
    """
    from transformers import TrainerCallback  # the caller's Trainer has imported it already

    class MemdCallback(TrainerCallback):  # type: ignore[misc]  # transformers is read as Any (pyproject.toml)
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            cuda = _cuda(device)
            if cuda is not None:
                cuda.reset_peak_memory_stats(device)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            cuda = _cuda(device)
            peak = int(cuda.max_memory_reserved(device)) if cuda is not None else None
            session.report(args.per_device_train_batch_size, peak_bytes=peak, step=state.global_step)

    return MemdCallback()


def lightning_callback(session: Session, device: Any = None) -> Any:
    """A Lightning Callback that reports each training batch's peak to the session.

    Works with ``lightning`` and the older ``pytorch_lightning`` package, whichever the caller
    uses. The batch size is the first dimension of the batch (its first tensor); build the
    DataLoader with ``plan.batch_size``.
    """
    try:
        from lightning.pytorch import Callback
    except ImportError:
        from pytorch_lightning import Callback

    class MemdCallback(Callback):  # type: ignore[misc]  # Lightning is read as Any (pyproject.toml)
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            cuda = _cuda(device)
            if cuda is not None:
                cuda.reset_peak_memory_stats(device)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            size = _batch_size(batch)
            if size:
                cuda = _cuda(device)
                peak = int(cuda.max_memory_reserved(device)) if cuda is not None else None
                session.report(size, peak_bytes=peak, step=trainer.global_step)

    return MemdCallback()


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

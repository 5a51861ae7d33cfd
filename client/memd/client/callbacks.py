"""The Hugging Face Trainer and Lightning callbacks behind ``memd.client.training``.

Their logic lives in two plain classes (``HFHooks``, ``LightningHooks``) that import no
framework; ``trainer_class()`` and ``lightning_class()`` make the framework's subclass once, at
first use, so that ``import memd.client.training`` loads neither transformers nor Lightning.

Both report every training step at the batch the framework really ran (the Trainer's
``state.train_batch_size``, which ``auto_find_batch_size`` lowers; the first dimension of
Lightning's batch) and every out-of-memory error before it leaves the Trainer: the
caller's process may die of it next, and a job that dies with ``ooms=0`` gets the same plan on its
next run and dies again.
"""
from __future__ import annotations

import functools
import logging
import sys
from types import FrameType
from typing import Any, Callable, Dict, Optional

from . import Session
from .plan import Plan

log = logging.getLogger("memd.client")

_GUARD = "_memd_guard"  # marks a method already wrapped by a callback (the wrapper's owner)
_REPORTED = "_memd_reported"  # marks an exception already reported (it passes several wrappers)
_FRAMES = 12  # how far up the stack on_train_begin looks for its Trainer


class _Owned:
    """A callback's session: the caller's, or one it opened itself and closes at train end."""

    def __init__(self, session: Optional[Session], device: Any, session_kwargs: Dict[str, Any]):
        if session is not None and session_kwargs:
            raise TypeError("pass a Session or the arguments to open one (%s), not both"
                            % ", ".join(sorted(session_kwargs)))
        if session is not None and not isinstance(session, Session):
            raise TypeError("session must be a memd.client.Session, not %r" % (type(session).__name__,))
        self.own_session = session is None
        if session is None:
            job = session_kwargs.pop("job", None)
            session = Session(job, **session_kwargs)
        self.session = session
        self.device = device

    def plan(self) -> Plan:
        """The session's plan now (for the next run's arguments: a running Trainer keeps its batch)."""
        return self.session.plan()

    def _close_own(self) -> None:
        if self.own_session:
            self.session.close()  # bye: the daemon keeps what this run taught at once


class HFHooks(_Owned):
    """``MemdCallback``'s logic (transformers' TrainerCallback is its other base)."""

    def __init__(self, session: Optional[Session] = None, *, device: Any = None, **session_kwargs: Any):
        super().__init__(session, device, session_kwargs)
        self._batch: Optional[int] = None  # the batch of the attempt under way (train begin to end)
        self._attempt_oom = False  # whether that attempt's out-of-memory error was reported
        self._auto_find = False  # whether auto_find_batch_size will catch it and train again

    def trainer_arguments(self) -> Dict[str, Any]:
        """The plan now as keyword arguments of transformers.TrainingArguments."""
        from .training import trainer_arguments
        return trainer_arguments(self.plan())

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        batch = _hf_batch(args, state)
        # auto_find_batch_size retries train() at a smaller batch only after an out-of-memory
        # error: one the guards below did not see (raised elsewhere in the step) is reported here.
        if (self._batch is not None and not self._attempt_oom and getattr(args, "auto_find_batch_size", False)
                and batch < self._batch):
            self.session.report_oom(self._batch)
        self._batch, self._attempt_oom = batch, False
        self._auto_find = bool(getattr(args, "auto_find_batch_size", False))
        trainer = _calling_trainer(self)
        if trainer is not None:
            self._guard(trainer, "training_step")  # forward and backward of one micro-batch
            self._guard(getattr(trainer, "optimizer", None), "step")  # where Adam's state is first allocated
        else:
            self._guard(kwargs.get("optimizer"), "step")
        plan = self.session.plan()
        if plan.source == "daemon" and plan.batch_size != batch:
            log.info("memd: the plan is now batch %d; this Trainer runs at batch %d (its batch is fixed: the "
                     "plan applies when the job is next started)", plan.batch_size, batch)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from .training import _cuda
        cuda = _cuda(self.device)
        if cuda is not None:
            cuda.reset_peak_memory_stats(self.device)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from .training import _cuda
        cuda = _cuda(self.device)
        peak = int(cuda.max_memory_reserved(self.device)) if cuda is not None else None
        self.session.report(_hf_batch(args, state), peak_bytes=peak, step=state.global_step)
        self.session.plan()  # a dictionary look-up while fresh; registers again after a daemon restart

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._batch = None
        self._close_own()

    def _guard(self, owner: Any, name: str) -> None:
        """Wrap ``owner.name`` (on the instance) so an out-of-memory error it raises is reported
        before it propagates; once per owner and callback."""
        method = getattr(owner, name, None)
        if method is None or not callable(method) or getattr(method, _GUARD, None) is self:
            return
        setattr(owner, name, _reporting(method, self._failed, self))

    def _failed(self, exc: BaseException, oom: bool) -> None:
        """An error is leaving a step: report it if it is an out-of-memory error; close this
        run's own session if it also leaves train() (only auto_find_batch_size catches, and
        only those). HF calls no callback on an error: this is the session's last chance."""
        if self._batch is None:
            return  # not inside this callback's train(): someone else's call
        if oom:
            self._attempt_oom = True
            self.session.report_oom(self._batch)
        if not (oom and self._auto_find):
            self._batch = None
            self._close_own()


class LightningHooks(_Owned):
    """``MemdLightningCallback``'s logic (Lightning's Callback is its other base)."""

    def __init__(self, session: Optional[Session] = None, *, device: Any = None, **session_kwargs: Any):
        super().__init__(session, device, session_kwargs)
        self._in_flight: Optional[int] = None  # the training batch started and not yet ended
        self._last: Optional[int] = None  # the latest training batch's size

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.session.plan()  # registers the session before the first report

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        from .training import _batch_size, _cuda
        self._in_flight = _batch_size(batch)
        if self._in_flight:
            self._last = self._in_flight
        cuda = _cuda(self.device)
        if cuda is not None:
            cuda.reset_peak_memory_stats(self.device)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        from .training import _cuda
        size, self._in_flight = self._in_flight, None
        if size:
            cuda = _cuda(self.device)
            peak = int(cuda.max_memory_reserved(self.device)) if cuda is not None else None
            self.session.report(size, peak_bytes=peak, step=trainer.global_step)
        self.session.plan()  # a dictionary look-up while fresh; registers again after a daemon restart

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Lightning calls this before the exception leaves ``fit``: an out-of-memory error is
        reported at the batch in flight (else the latest training batch, else the plan's: the
        job ran out of memory at that configuration, in validation or elsewhere)."""
        from .training import is_oom
        try:
            if is_oom(exception) and not getattr(exception, _REPORTED, False):
                batch = self._in_flight or self._last or self.session.plan().batch_size
                self.session.report_oom(batch)
                _mark(exception)
        finally:
            self._in_flight = None
            self._close_own()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close_own()


def _reporting(method: Callable[..., Any], failed: Callable[[BaseException, bool], None],
               owner: Any) -> Callable[..., Any]:
    """``method``, telling ``failed`` of an error it raises (once per exception, and whether it
    is an out-of-memory error) before re-raising it."""

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except BaseException as exc:
            if not getattr(exc, _REPORTED, False):
                from .training import is_oom
                _mark(exc)
                try:
                    failed(exc, is_oom(exc))
                except Exception:  # never let the advisor replace the training loop's own error
                    pass
            raise

    setattr(guarded, _GUARD, owner)
    return guarded


def _mark(exc: BaseException) -> None:
    try:
        setattr(exc, _REPORTED, True)
    except AttributeError:  # an exception type without a __dict__: it may be reported twice
        pass


def _hf_batch(args: Any, state: Any) -> int:
    """The batch each device's micro-batch has now: the Trainer's own (``auto_find_batch_size``
    lowers it; DataParallel splits it over ``n_gpu``), else the arguments'."""
    total = getattr(state, "train_batch_size", None)
    if isinstance(total, int) and total > 0:
        return max(1, total // max(1, int(getattr(args, "n_gpu", 1) or 1)))
    return int(args.per_device_train_batch_size)


def _calling_trainer(callback: Any) -> Any:
    """The Trainer whose on_train_begin is calling ``callback``: callbacks are not handed their
    Trainer, so it is found up the stack as the object whose callback handler holds this one."""
    frame: Optional[FrameType] = sys._getframe(2)
    for _ in range(_FRAMES):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        handler = getattr(candidate, "callback_handler", None)
        if handler is not None and any(c is callback for c in getattr(handler, "callbacks", ())):
            return candidate
        frame = frame.f_back
    return None


_classes: Dict[str, type] = {}


def trainer_class() -> type:
    """MemdCallback: HFHooks on transformers' TrainerCallback (built once)."""
    if "hf" not in _classes:
        from transformers import TrainerCallback
        _classes["hf"] = type("MemdCallback", (HFHooks, TrainerCallback), {
            "__module__": "memd.client.training", "__doc__": HF_DOC})
    return _classes["hf"]


def lightning_class() -> type:
    """MemdLightningCallback: LightningHooks on the Callback of the Lightning the caller uses
    (``lightning.pytorch`` if imported or installed, else ``pytorch_lightning``)."""
    if "lightning" not in _classes:
        if "lightning.pytorch" in sys.modules or "pytorch_lightning" not in sys.modules:
            try:
                from lightning.pytorch import Callback
            except ImportError:
                from pytorch_lightning import Callback
        else:
            from pytorch_lightning import Callback
        _classes["lightning"] = type("MemdLightningCallback", (LightningHooks, Callback), {
            "__module__": "memd.client.training", "__doc__": LIGHTNING_DOC})
    return _classes["lightning"]


HF_DOC = """A transformers TrainerCallback that reports every optimizer step and every out-of-memory error.

    MemdCallback(session=None, *, device=None, **session_kwargs)

Give it a Session, or the Session's arguments (``job=``, ``target_effective_batch=``, ``hints=``...)
and it opens its own, closed when training ends or an error in a step leaves ``train()``. Each optimizer
step is reported at the batch the Trainer really runs (``state.train_batch_size``: under
``auto_find_batch_size`` the one it shrank to), with the CUDA allocator's peak (on the CPU the
daemon measures the process). An out-of-memory error in the forward, backward or optimizer
step is reported before it leaves ``train()``; each retry of ``auto_find_batch_size`` is an
out-of-memory error at the batch before. The Trainer's batch is fixed when it is built: take it
from ``callback.trainer_arguments()``; a later plan applies when the job is next started
(docs/training.md).
"""

LIGHTNING_DOC = """A Lightning Callback that reports every training batch and every out-of-memory error.

    MemdLightningCallback(session=None, *, device=None, **session_kwargs)

Give it a Session, or the Session's arguments, and it opens its own, closed when ``fit`` ends.
Each training batch is reported at its real size (the first dimension of its first tensor),
an out-of-memory error through ``on_exception``, before it leaves ``fit``. Build the DataLoader
with ``callback.plan().batch_size``; a later plan applies when the job is next started
(docs/training.md).
"""

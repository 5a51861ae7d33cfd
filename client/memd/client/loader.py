"""A DataLoader that follows memd's plan: its batch size, its workers and prefetch, its throttle.

    from memd import client
    from memd.client.training import MemdLoader

    with client.Session(job="vit", num_workers=8) as s:
        loader = MemdLoader(dataset, s, shuffle=True)
        for epoch in range(epochs):
            for batch in loader:               # each batch is one step's: nothing else to report
                ...

Each epoch draws its order from the sampler once. When the plan's batch size grows, or shrinks
by less than a tenth, the next batches the workers are handed take the new size (those already
prefetched come at the old one): the workers, and what each has copied of the dataset, stay.
When it shrinks further, or the workers or prefetch change, the DataLoader is rebuilt at the next
batch boundary over the samples the epoch has not delivered yet, so none is lost or repeated
(batches the old workers had prefetched are dropped, not delivered). While the plan says
``throttle`` the loader waits before fetching more, up to ``throttle_wait`` seconds at a time.
Each batch after the first tells the session the step before it ran (the daemon measures what it
cost), with the batch's bytes, as ``suggest_batch`` does; pass ``report=False`` when the loop
reports its steps itself, and call ``report_oom()`` when a step on the latest batch ran out of
memory. Under torch.distributed every rank follows the same plan (``agreed_plan``): iterate the
loader on every rank in step. As it starts workers it freezes the objects Python's cycle
collector tracks (``gc.freeze``), so that no collection copies the pages the workers share with
the trainer; those objects are then freed by reference counting alone. And it moves the batch the
loop still holds out of shared memory (the same tensors, the same values): a fork inherits it, and
it would stay in memory as long as the new workers live. Each worker gives its C heap's free
pages back to the kernel after the batches it collates (``_TrimmingCollate``).
torch is imported when a MemdLoader is built, never by ``import memd.client``.
"""
from __future__ import annotations

import collections
import gc
import sys
import time
import weakref
from typing import Any, Deque, Iterator, List, Optional, Tuple

from .heap import StepTrimmer, trim_heap
from .plan import Plan

THROTTLE_POLL = 0.05  # seconds between looks at the plan while throttled
# A cut to at least this share of the batch is taken by the next batches handed out, without a
# rebuild; a deeper one rebuilds at once, dropping the batches prefetched at the old size. The
# benchmark's loader, its plan moving 2-5 % at a time (726, 694, 679, 700, 680), rebuilt at
# every cut: its one worker, forked anew each time, copied the dataset again and never levelled
# off, so it was counted at the 0.6 GiB it could copy at most where it levels at 0.33.
SMALL_CUT = 0.9
_Config = Tuple[int, int, Optional[int]]  # a DataLoader's batch size, workers and prefetch factor


class _Chunks:
    """The batch sampler the DataLoader is built with: this epoch's remaining indices, cut into
    batches of ``size`` (re-iterable, so persistent workers serve every epoch). ``size`` may
    grow between batches; the size of each batch handed out waits in ``sizes`` until the batch
    arrives (in order, as the DataLoader delivers them)."""

    def __init__(self, indices: List[int], size: int, drop_last: bool):
        self.indices, self.size, self.drop_last = indices, size, drop_last
        self.sizes: Deque[int] = collections.deque()

    def __iter__(self) -> Iterator[List[int]]:
        start = 0
        while start < len(self.indices):
            size = self.size
            chunk = self.indices[start:start + size]
            if len(chunk) < size and self.drop_last:
                return
            self.sizes.append(len(chunk))
            yield chunk
            start += size

    def __len__(self) -> int:
        whole, rest = divmod(len(self.indices), self.size)
        return whole + (1 if rest and not self.drop_last else 0)


class MemdLoader:
    def __init__(self, dataset: Any, session: Any, *, sampler: Any = None, shuffle: bool = False,
                 drop_last: bool = False, persistent_workers: bool = True, report: bool = True,
                 throttle_wait: float = 5.0, group: Any = None, **loader_kwargs: Any):
        """``loader_kwargs`` go to every DataLoader built (collate_fn, pin_memory,
        worker_init_fn, ...); batch size, workers and prefetch come from the plan."""
        import torch.utils.data as data

        for fixed in ("batch_size", "num_workers", "prefetch_factor", "batch_sampler"):
            if fixed in loader_kwargs:
                raise TypeError("MemdLoader takes %s from the plan, not as an argument" % fixed)
        self.dataset, self.session, self.group = dataset, session, group
        self.sampler = sampler if sampler is not None else (
            data.RandomSampler(dataset) if shuffle else data.SequentialSampler(dataset))
        self.drop_last, self.persistent_workers = drop_last, persistent_workers
        self.report, self.throttle_wait = report, throttle_wait
        self.loader_kwargs = loader_kwargs
        self.batches = 0  # delivered, over all epochs
        self.builds = 0  # DataLoaders built
        self.plan: Optional[Plan] = None
        self._loader: Any = None  # torch's DataLoader
        self._config: Optional[_Config] = None
        # (batch size, bytes) of the batch delivered last, not yet reported
        self._last: Optional[Tuple[int, int]] = None
        self._held: List[Any] = []  # weak references to the tensors of the batch delivered last

    def set_epoch(self, epoch: int) -> None:
        """Passed on to a sampler that has it (DistributedSampler)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        order = list(iter(self.sampler))
        position = 0
        batches: Optional[Iterator[Tuple[int, Any]]] = None
        while position < len(order):
            plan = self._next_plan()
            config = (plan.batch_size, plan.num_workers, plan.prefetch_factor if plan.num_workers else None)
            if self._loader is not None and self._config is not None \
                    and config[1:] == self._config[1:] and config[0] >= SMALL_CUT * self._config[0]:
                # Growth, or a small cut, here or at an epoch's first batch: the next batches
                # handed out take the new size; the workers, and what each has copied of the
                # dataset, stay (a rebuild forks new ones that copy it again).
                self._chunks.size, self._config = config[0], config
            if self._loader is None or config != self._config or batches is None:
                if self._loader is not None and config != self._config:
                    self._close()
                    batches = None  # and the batch it handed out last with it
                    trim_heap()  # the old batch's and workers' memory back to the OS before the new one
                batches = self._start(order[position:], config)
            try:
                indices, batch = next(batches)
            except StopIteration:
                break
            position += indices
            self._delivered(batch, indices)
            yield batch
            batch = None  # the loop's to hold, not this frame's: a rebuild would fork new workers with it
            self._report_last()  # the step ran: said now, before the next batch is collated

    def _next_plan(self) -> Plan:
        from .training import agreed_plan

        plan = agreed_plan(self.session, self.group)
        deadline = time.monotonic() + self.throttle_wait
        while plan.throttle and time.monotonic() < deadline:
            time.sleep(THROTTLE_POLL)  # memory is nearly gone: fetch nothing more for now
            plan = agreed_plan(self.session, self.group)
        self.plan = plan
        return plan

    def _start(self, remaining: List[int], config: _Config) -> Iterator[Tuple[int, Any]]:
        """An iterator of (samples, batch) over ``remaining``, reusing the DataLoader (and its
        persistent workers) when the plan has not changed."""
        import torch.utils.data as data

        size, workers, prefetch = config
        built = self._loader is None or config != self._config
        if built:
            self._chunks = _Chunks(remaining, size, self.drop_last)
            kwargs = dict(self.loader_kwargs)
            if workers:
                kwargs.update(prefetch_factor=prefetch, persistent_workers=self.persistent_workers,
                              collate_fn=_TrimmingCollate(kwargs.get("collate_fn")))
            self._loader = data.DataLoader(self.dataset, batch_sampler=self._chunks, num_workers=workers, **kwargs)
            self._config = config
            self.builds += 1
        else:
            self._chunks.indices = remaining  # a new epoch through the same workers
        self._chunks.sizes.clear()
        if workers and (built or not self.persistent_workers):  # forked as its iterator starts, just below
            _spare_from_collection()
            _unshare(self._held)
        return ((self._chunks.sizes.popleft(), batch) for batch in self._loader)

    def _report_last(self) -> None:
        """The step on the batch delivered last ran clean: reported before the next batch is
        fetched, so the peak the daemon measures for it is that step's alone. Reported after the
        next batch was collated (its samples and their stack held at once), a step at 27 was
        measured at the next one's collate of 36, and the step at 36 at a third less than its peak;
        the plan grew on it to 41 and the kernel killed the job (bench/exam.py)."""
        if self.report and self._last is not None:
            size, nbytes = self._last
            self._last = None
            # loader_workers says this loader follows the plan's workers (it shuts the old ones
            # down before the next batch of a new plan).
            self.session.report(size, batch_bytes=nbytes, loader_workers=self._config[1] if self._config else None)

    def _delivered(self, batch: Any, samples: int) -> None:
        self.batches += 1
        tensors = list(_tensors(batch))
        self._last = (samples, sum(t.element_size() * t.nelement() for t in tensors))
        self._held = [weakref.ref(t) for t in tensors]

    def report_oom(self) -> None:
        """The batch delivered last ran out of memory: the session cuts the plan (the next batch is
        already smaller) and that step is not reported as clean. Its samples are not delivered again."""
        if self._last is not None:
            size, self._last = self._last[0], None
            self.session.report_oom(size)

    def _close(self) -> None:
        loader, self._loader = self._loader, None
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()  # persistent workers end now, not when collected

    def __len__(self) -> int:
        plan = self.plan or self.session.plan()
        return len(_Chunks(list(range(len(self.sampler))), plan.batch_size, self.drop_last))


class _TrimmingCollate:
    """The loader's collate_fn, after which a worker frees the batch's samples (copied into the
    batch by the default collate) and gives its C heap's free pages back to the kernel (while
    that costs at most 5 % of the time between its batches: StepTrimmer). Left to the worker, a
    batch's samples are freed after the collate returns, into holes under whatever the worker
    allocated after them, and stay resident: beside a trainer, the benchmark loader's one worker
    held 8 MiB in its heap at 90 s and 32 at 480 s (its copy of the dataset flat at 312), 29 of
    them past the heap it was forked with and nearly all float32 sample data, one batch of 954
    samples of 32 KiB; memd, costing the worker at what it held, cut the batch 955 -> 921. A
    trim after the collate alone changed nothing there: the samples were still alive. Dropped
    first, the worker's heap held 3-4 MiB between batches. In the trainer (no worker) the
    session trims after each step."""

    def __init__(self, collate: Any = None):
        self.collate = collate
        self._trimmer: Optional[StepTrimmer] = None  # made in the worker: each worker times its own

    def __call__(self, samples: Any) -> Any:
        import torch.utils.data as data

        batch = (self.collate or data.default_collate)(samples)
        if data.get_worker_info() is not None:
            if self.collate is None and isinstance(samples, list) and batch is not samples:
                samples.clear()  # copied into the batch: freed now, before the trim, not after it
            if self._trimmer is None:
                self._trimmer = StepTrimmer()
            self._trimmer.step_ended()
        return batch


def _spare_from_collection() -> None:
    """Keep Python's cycle collector off the objects the workers are about to be forked with. A
    full collection writes into every object it tracks, and a page a forked worker still shares is
    copied when either process writes to it: on the benchmark's workers job (1,200 records kept
    as Python lists, one worker), one full collection in the trainer added 60 MiB to the worker's
    own memory and 60 MiB to the trainer's, and MemdLoader beside one worker, its group within
    tens of MiB of full, was killed 4 s after such a rise of 66 MiB, 880 steps in. Frozen first,
    as Python's documentation advises before a fork (gc.freeze), the same collection copied
    nothing. What is frozen stays with reference counting: the objects alive as the workers
    start (model, optimizer, dataset) live as long as the job anyway."""
    gc.collect()  # what is garbage already goes now, not frozen with the rest
    gc.freeze()


def _tensors(batch: Any) -> Iterator[Any]:
    """The tensors in a batch (a tensor, or sequences and mappings of them)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)


def _unshare(held: List[Any]) -> None:
    """Move the tensors of the batch the loop may still hold out of shared memory, in place (the
    same tensors, the same values, in the trainer's own memory), before new workers are forked.
    A fork inherits the trainer's descriptor and mapping of every shared batch it holds, and the
    batch then lives as long as the new workers do, however soon the loop lets go of it:
    bench/rebuildpin.py, one worker at prefetch 1, a rebuild 300 -> 100 left the new worker
    holding the batch of 300 (29.3 MiB) open, the loop holding its batch or not (MemdLoader's
    own references held it). On the benchmark's workers job, an extra batch in the group's shared
    memory for the rest of the run after a rebuild (memd costs it: policy _in_flight)."""
    import torch

    with torch.no_grad():
        for ref in held:
            tensor = ref()
            if tensor is not None and tensor.device.type == "cpu" and tensor.is_shared():
                tensor.set_(tensor.clone())

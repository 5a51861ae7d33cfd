"""Give the C heap's free pages back to the kernel between training steps.

glibc keeps memory a program frees for reuse: a CPU training step's activations, freed at its
end, stay resident (and charged to the job's cgroup) in chunks the next step's tensors may not
fit, so a step's peak rides on what earlier steps left. Measured on a GPT-style CPU job in a
1 GiB cgroup (docs/results.md): after a few changes of batch the same batch peaked 6-10 % higher
than in a fresh process, and even at one batch its peaks were bimodal and crept up by 10 % over
a dozen steps (939-1049 MiB); trimmed after every step they held at 930-940 MiB, for 2.5 % of
the run's time.
``malloc_trim(0)`` returns every free page, holes in the middle of the heap included. Elsewhere
(musl, macOS) there is nothing to call and it does nothing.

A trim comes after the step; the spread comes from inside it. glibc serves an allocation of
128 KiB or more with its own mmap, given back when freed, but raises that threshold to the
size of each such block freed (up to 32 MiB): after a first step, a CPU job's activations come
from the heap instead, where what a step leaves in the middle decides where the next step's
tensors land. Held at its starting 128 KiB (``steady_heap``), the same batch peaked the same at
every step: a CNN at batch 560 in a 1 GiB cgroup at 797-812 MiB anonymous instead of 834-883, a
GPT-style job at batch 40 in 1.5 GiB at 875-889 instead of 888-1006 (bench/heapcost.py has the cost).

A process forked from it (a DataLoader worker) builds each batch from per-sample buffers that
are freed once the batch is collated into shared memory; from the heap, what they leave stays
resident in every worker, more in one loader's workers than in the next. In a 2 GiB cgroup four
workers' C heaps held 4.8-10.1 MiB each, the loader deciding which, while their copies of the
dataset held 307-309 in every loader. A forked child therefore maps blocks of 16 KiB or more
(``WORKER_MMAP_THRESHOLD``), given back whole when freed (bench/workerheap.py has the cost).
"""
from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any, Callable, Optional

_trim: Optional[Any] = None
_probed = False
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h); setting it also stops the threshold rising
STEADY_MMAP_THRESHOLD = 128 * 1024  # glibc's own starting threshold
WORKER_MMAP_THRESHOLD = 16 * 1024  # in a forked child: a loader worker's per-sample buffers
_steady: Optional[bool] = None
_mallopt: Optional[Any] = None


def steady_heap() -> bool:
    """Keep glibc's mmap threshold at its starting 128 KiB for the rest of the process, so a
    step's large tensors are mapped and unmapped whole and its peak does not depend on what
    earlier steps left in the heap; in the processes it forks, at 16 KiB (the module's note).
    Once per process; ``MEMD_STEADY_HEAP=0`` leaves the heap alone. False where there is no
    glibc (nothing to set) or it was left alone. Never raises."""
    global _steady, _mallopt
    if _steady is None:
        _steady = False
        if os.environ.get("MEMD_STEADY_HEAP", "1").strip() not in ("0", "no", "false", "off"):
            try:
                mallopt = ctypes.CDLL(None).mallopt
                mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                _steady = mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD) == 1
            except Exception:
                _steady = False
            if _steady:
                _mallopt = mallopt
                if hasattr(os, "register_at_fork"):
                    os.register_at_fork(after_in_child=_steady_child)
    return _steady


def _steady_child() -> None:
    """In a forked child (a loader worker): blocks of WORKER_MMAP_THRESHOLD or more are mapped."""
    try:
        if _mallopt is not None:
            _mallopt(_M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD)
    except Exception:
        pass


def trim_heap() -> bool:
    """Give back what the last batch size left held, before a step at a new one: the C heap's
    free pages to the kernel (glibc's malloc_trim), and, where this process's PyTorch has set up
    CUDA, the blocks its caching allocator keeps free (torch.cuda.empty_cache()). Kept, those
    blocks stay in the allocator's reserved bytes and in what the driver counts for the process,
    the two peaks memd learns from on a GPU: on an H200 a job's steps at 70, 55 and 49 after 73
    each reported the 15.1 GiB reserved at 73 (14.3 GiB at 70 before it), the line through them
    put more than the budget at batch 1, and the plan went 73 -> 1 in 16 steps
    (docs/results.md). False where there is no malloc_trim. Never raises."""
    _release_cuda_cache()
    return _trim_c_heap()


def _release_cuda_cache() -> None:
    """Only at a change of batch: emptied every step, the allocator would ask the driver for
    its blocks again each step."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:
        pass


def _trim_c_heap() -> bool:
    global _trim, _probed
    if not _probed:
        _probed = True
        try:
            _trim = ctypes.CDLL(None).malloc_trim
            _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _trim = None
    if _trim is None:
        return False
    try:
        _trim(0)
        return True
    except Exception:
        return False


class StepTrimmer:
    """Trims at the end of a step while that is cheap beside it: the last trim took at most
    ``share`` of the time since the previous step ended, and at most ``limit`` seconds."""

    def __init__(self, share: float = 0.05, limit: float = 0.05, trim: Optional[Callable[[], object]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.share, self.limit = share, limit
        self.trim, self.clock = trim or _trim_c_heap, clock
        self.cost = 0.0  # seconds the last trim took
        self.boundary: Optional[float] = None  # when the previous step ended

    def step_ended(self) -> None:
        now = self.clock()
        if self.boundary is not None and self.cost <= min(self.limit, self.share * (now - self.boundary)):
            self.trim()
            self.cost = self.clock() - now
        self.boundary = self.clock()

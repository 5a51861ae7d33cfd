"""Give the C heap's free pages back to the kernel when a job's batch size changes.

glibc keeps memory a program frees for reuse, and a step at a new batch size allocates tensors
of new sizes that the old sizes' free chunks cannot hold, so each change of batch leaves the
heap holding the old sizes' chunks besides the new ones: measured on a GPT-style CPU job, the
same batch peaked 6-10 % higher after a few changes than in a fresh process (docs/policy.md).
``malloc_trim(0)`` returns every free page, holes in the middle of the heap included, so the new
batch is charged for its own memory only. It costs a few milliseconds per GB of heap, once per
change of batch; elsewhere (musl, macOS) there is nothing to call and it does nothing.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional

_trim: Optional[Any] = None
_probed = False


def trim_heap() -> bool:
    """Return the C heap's free pages to the kernel (glibc's malloc_trim); False where there is
    no such call. Never raises."""
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

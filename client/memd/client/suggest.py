"""``suggest_batch``: the one-line integration, over one lazily created Session per process."""
from __future__ import annotations

import os
import threading
from typing import Any, Optional, Set

from .checks import warn_once
from .conversation import Session
from .counts import whole
from .heap import trim_heap

_process_session: Optional[Session] = None
_process_session_pid = 0
_process_lock = threading.Lock()


def suggest_batch(default: int, **session_kwargs: Any) -> int:
    """The batch size to use now, as an int; ``default`` if anything at all goes wrong.

    Call it once per training step. Each call after the first tells the daemon that the step
    since the last call ran clean at the batch it suggested then, and the daemon measures what
    that step cost (the job's peak memory since the previous call), so the suggestions follow
    the job's real memory curve with no report from the caller. When the answer changes, the C
    heap's free pages and, on a GPU, PyTorch's cached blocks are given back first
    (``trim_heap``), so the new batch is not charged for the old one's. One Session is created
    lazily per process (the first call's keyword arguments configure it);
    ``memd.client.session()`` returns it, to report an out-of-memory error with ``report_oom``.

    The batch is in whatever unit the step's memory follows: a job whose sequences vary in
    length from step to step asks for tokens (``default`` in tokens, say four of its longest
    sequences) and runs ``max(1, tokens // length)`` sequences of each step's length. Asked for
    sequences, memd grows on short steps, and a longer one can then run out of memory.
    """
    default = _usable_default(default)
    try:
        s = session(default_batch=default, **session_kwargs)
        s._step_done()
        plan = s.plan()
        if s._last_suggested is not None and plan.batch_size != s._last_suggested:
            trim_heap()
        s._last_suggested = plan.batch_size
        s._suggested = plan.batch_size if plan.source == "daemon" else None
        return plan.batch_size
    except Exception:
        return default


_suggest_warned: Set[object] = set()


def _usable_default(default: Any) -> int:
    """``default`` as the int suggest_batch promises; one that is not a whole number of at least
    1 ('big', 0, NaN, True) is 1, the batch that fits wherever any does, with a warning once.
    Returned as given, a default of 'big' came back as 'big' from every call."""
    if whole(default) and default >= 1:
        return default
    if isinstance(default, float) and default.is_integer() and default >= 1:
        return int(default)
    warn_once(_suggest_warned, ("default", repr(default)[:64]), "memd: suggest_batch(default=%r) is not a whole "
              "number >= 1; using 1", default)
    return 1


def session(**session_kwargs: Any) -> Session:
    """The process-wide Session behind ``suggest_batch`` (created on first use)."""
    global _process_session, _process_session_pid
    with _process_lock:
        if _process_session is None or _process_session_pid != os.getpid():
            job = session_kwargs.pop("job", None)
            _process_session = Session(job, **session_kwargs)
            _process_session_pid = os.getpid()
        return _process_session

"""memd's client: ask the local memd daemon which batch size to use now.

    from memd import client
    bs = client.suggest_batch(default=32)            # an int, always; never raises

    with client.Session(job="llama-ft", target_effective_batch=64, max_batch=128) as s:
        plan = s.plan()
        s.report(batch_size=plan.batch_size, peak_bytes=torch.cuda.max_memory_reserved())

No call blocks longer than ``timeout`` (50 ms by default) and none raises because the daemon is
absent, slow, restarting or answering garbage: the plan then comes from a local fallback
(``plan.source == "fallback"``) and the session reconnects by itself later. The client imports
pyzmq and msgpack and nothing of the daemon's.

This package loads its parts on first use: ``import memd.client.plan`` (the Plan record and the
effective-batch rule, which the daemon's pure policy shares) imports neither pyzmq nor msgpack
and installs no fork hook. Where each name lives:

- conversation.py: ``Session`` (a job's conversation with the daemon); transport.py its socket
- suggest.py: ``suggest_batch``, ``session`` (the process-wide Session behind it)
- oneshot.py: ``call``, ``DaemonUnavailable``, ``Refused`` (one request, for tools)
- plan.py: ``Plan``, ``split_batch``; heap.py: ``trim_heap``, ``steady_heap``
- protocol.py (wire schema), endpoint.py (default endpoint), curve.py (CURVE keys),
  training.py and loader.py (torch and framework integrations), identity.py (who is asking),
  checks.py (a caller's arguments checked)
- counts.py (the whole-number rule) and procstat.py (/proc/PID/stat), plain Python the daemon
  shares
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:  # what a reader (and mypy) sees; at run time __getattr__ loads them on first use
    from .conversation import Session
    from .heap import steady_heap, trim_heap
    from .identity import usable_cpus as usable_cpus
    from .oneshot import DaemonUnavailable, Refused, call
    from .plan import Plan, split_batch
    from .suggest import session, suggest_batch

__all__ = ["Plan", "Session", "suggest_batch", "session", "split_batch", "call", "DaemonUnavailable", "Refused",
           "trim_heap", "steady_heap"]

#: Each public name and the module it lives in.
_HOME = {
    "Plan": "plan", "split_batch": "plan", "Session": "conversation", "suggest_batch": "suggest",
    "session": "suggest", "call": "oneshot", "DaemonUnavailable": "oneshot", "Refused": "oneshot",
    "trim_heap": "heap", "steady_heap": "heap", "usable_cpus": "identity",
}
_MODULES = ("checks", "conversation", "counts", "curve", "endpoint", "heap", "identity", "loader", "oneshot", "plan",
            "procstat", "protocol", "suggest", "training", "transport")


def __getattr__(name: str) -> Any:
    """``memd.client.Session`` and the rest, imported when first asked for, then kept here."""
    if name in _HOME:
        value = getattr(importlib.import_module("." + _HOME[name], __name__), name)
    elif name in _MODULES:
        value = importlib.import_module("." + name, __name__)
    else:
        raise AttributeError("module %r has no attribute %r" % (__name__, name))
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_HOME) | set(_MODULES))

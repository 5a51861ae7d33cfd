"""The protocol's operations: one handler per op, its docstring the wire specification.

Each handler takes the Core and the decoded request map and returns the ``result`` map; it
raises Invalid for a bad field and lets UnknownSession / TooManySessions through. Only the
server adds the envelope (v, id, ok) and maps exceptions to error codes (docs/protocol.md).

A request's path, top to bottom: fields (check the request) -> watch (what the daemon reads of
the job's own process) -> memo (the policy's decision, through memd.planner, memoised) ->
the session record (memd.sessions); lifecycle ends sessions and keeps what they learned.
session_ops holds the ops of one job's session, daemon_ops those that need none.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from memd.client import protocol
from memd.core import Core
from memd.ops.daemon_ops import curves, forget, ping, status
from memd.ops.fields import Invalid
from memd.ops.lifecycle import end, expire, remember
from memd.ops.memo import NotReady
from memd.ops.session_ops import bye, hello, oom, plan, report

Result = Dict[str, Any]

HANDLERS: Dict[str, Callable[[Core, Dict[str, Any]], Result]] = {
    "hello": hello, "plan": plan, "report": report, "oom": oom, "bye": bye, "status": status, "ping": ping,
    "curves": curves, "forget": forget,
}
assert set(HANDLERS) == set(protocol.OPS)

__all__ = ["HANDLERS", "Invalid", "NotReady", "Result", "bye", "curves", "end", "expire", "forget", "hello", "oom",
           "ping", "plan", "remember", "report", "status"]

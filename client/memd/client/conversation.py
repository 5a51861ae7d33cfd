"""Session: one training job's conversation with the daemon (its limits, its cached plan, the
reports it has not delivered yet), and the local fallback when the daemon does not answer.
The socket itself is transport.py's; what callers hand over is checked by checks.py.
"""
from __future__ import annotations

import collections
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, Optional, Set, Tuple

import zmq

from . import curve, protocol
from .checks import clean_hints, count, optional_count, warn_once, wire_number
from .heap import StepTrimmer, steady_heap
from .identity import (
    default_job,
    device_identity,
    distributed_identity,
    process_identity,
    scheduler_identity,
    usable_cpus,
)
from .plan import Plan, fallback_plan, within_limits
from .transport import BACKOFF_FIRST, ErrorReply, NoReply, Transport

_BACKOFF_MAX = 2.0
_PENDING_REPORTS = 16  # reports kept while the daemon cannot take them; older ones are dropped

_sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()


class Session(Transport):
    """One training job's conversation with the daemon.

    Thread-safe; fork-safe (a forked dataloader worker never touches its parent's socket: the
    child's copy starts over, lazily, as a session of its own). Everything the daemon said is
    cached, so ``plan()`` costs a dictionary look-up while the last plan is fresh. Only the
    constructor raises: on limits that are not counts, contradict each other or lie beyond
    docs/protocol.md's ranges, and on CURVE keys passed that cannot be used (found before
    training starts); nothing a training loop hands a method later makes it raise.

    A daemon on ``tcp://`` beyond loopback talks only CURVE: ``server_key`` is its public key
    (40 Z85 characters, or its ``.key`` file), ``client_key_file`` this client's ``.key_secret``
    file, whose public key the daemon's allow-list must hold (else MEMD_SERVER_KEY and
    MEMD_CLIENT_KEY_FILE; docs/deploy.md). A refused key looks like an absent daemon: fallback.
    """

    _ceiling: Optional[int]  # the batch a local out-of-memory error backed off to; set in _reset

    def __init__(
        self,
        job: Optional[str] = None,
        *,
        endpoint: Optional[str] = None,
        timeout: float = 0.05,
        target_effective_batch: Optional[int] = None,
        min_batch: int = 1,
        max_batch: Optional[int] = None,
        default_batch: Optional[int] = None,
        device: Any = None,
        hints: Optional[Dict[str, Any]] = None,
        num_workers: Optional[int] = None,
        server_key: Optional[str] = None,
        client_key_file: Optional[str] = None,
    ):
        self.job = (str(job) if job is not None else default_job())[:128]  # the daemon takes 128 characters
        self.endpoint = endpoint or protocol.default_endpoint()
        self.timeout = float(timeout)
        if not self.timeout > 0:
            raise ValueError("timeout must be a positive number of seconds, not %r" % (timeout,))
        self._timeout_ms = max(1, int(self.timeout * 1000))
        self.min_batch = count(min_batch, "min_batch")
        self.max_batch = optional_count(max_batch, "max_batch")
        self.default_batch = optional_count(default_batch, "default_batch")
        self.target_effective_batch = optional_count(target_effective_batch, "target_effective_batch")
        if self.max_batch is not None and self.max_batch < self.min_batch:
            raise ValueError("max_batch (%d) is below min_batch (%d)" % (self.max_batch, self.min_batch))
        if self.target_effective_batch is not None and self.target_effective_batch < self.min_batch:
            raise ValueError("target_effective_batch (%d) is below min_batch (%d)"
                             % (self.target_effective_batch, self.min_batch))
        self.device = device
        self._warned: Set[object] = set()  # what this session already warned about: once is enough
        if num_workers is not None:  # the workers the job would like: memory and pressure only cut from there
            hints = dict(hints or {}, num_workers=count(num_workers, "num_workers", allow_zero=True))
        self.hints = clean_hints(hints, self._warned)
        self.server_key, self.client_key_file = server_key, client_key_file
        self._curve, self._curve_problem = _curve_keys(server_key, client_key_file, self._warned)
        self._lock = threading.Lock()
        self._reset()
        _sessions.add(self)
        steady_heap()  # a step's peak that does not depend on the steps before it (heap.py)

    # -- public API -------------------------------------------------------------------------

    def plan(self) -> Plan:
        """The plan to follow now: cached while fresh, else asked for within ``timeout``."""
        if not self._lock.acquire(timeout=self.timeout):
            return self._fallback("session busy in another thread")
        try:
            self._check_fork()
            now = time.monotonic()
            if self._plan is not None and now < self._plan_expires:
                self._drain()  # replies to earlier reports may carry a newer plan (not a fresher one)
                return self._plan
            if now < self._retry_at:
                return self._fallback("daemon unavailable; retrying in %.1f s" % (self._retry_at - now))
            deadline = now + self.timeout
            try:
                return self._ask_plan(deadline)
            except ErrorReply as exc:
                if exc.code != protocol.UNKNOWN_SESSION:
                    self._failed()
                    return self._fallback("daemon refused (%s)" % (exc,))
            except NoReply as exc:
                self._failed()
                return self._fallback("daemon unavailable (%s)" % (exc,))
            try:  # the daemon restarted or expired us: register again within the same deadline
                return self._ask_plan(deadline)
            except (NoReply, ErrorReply) as exc:
                self._failed()
                return self._fallback("daemon unavailable (%s)" % (exc,))
        except Exception as exc:  # never let the advisor break the training loop
            return self._fallback("client error: %r" % (exc,))
        finally:
            self._lock.release()

    def _ask_plan(self, deadline: float) -> Plan:
        self._ensure_session(deadline)
        if self._plan is not None and time.monotonic() < self._plan_expires:
            return self._plan  # hello (or a drained reply) just brought one
        self._accept(self._call("plan", deadline, token=self._token))
        if self._plan is None:  # a reply that carried no plan, and none before it
            raise NoReply("the daemon's reply carried no plan")
        return self._plan

    def report(self, batch_size: int, peak_bytes: Optional[int] = None, *, step: Optional[int] = None,
               step_seconds: Optional[float] = None, batch_bytes: Optional[int] = None,
               loader_workers: Optional[int] = None) -> None:
        """Tell the daemon what a step cost. Never waits, never raises: the reply (a new plan) is
        picked up later; a field that is not a number in its protocol range (NaN, negative, beyond
        1 PiB) is left out with a warning, once, and a report without a usable batch size is dropped.

        ``peak_bytes=None`` asks the daemon to measure the job's process tree itself;
        ``batch_bytes``: one batch's tensors (a loader's report: each worker keeps prefetch_factor
        of them in flight); ``loader_workers``: the workers it came from, sent by a loader that
        follows the plan's workers (MemdLoader), so the daemon plans its batch beside the
        workers the plan keeps, not beside those about to be shut down. A step has
        ended, so the C heap first gives back what the step freed (``trim_heap``), while that
        costs at most 5 % of the step and never more than ``timeout``: glibc keeps a CPU step's
        freed activations resident, and the next step's peak rides on them.
        """
        fields: Dict[str, Any] = {}
        given = (("batch_size", batch_size), ("peak_bytes", peak_bytes), ("step", step),
                 ("step_seconds", step_seconds), ("batch_bytes", batch_bytes), ("loader_workers", loader_workers))
        for name, value in given:
            if value is not None:
                checked = wire_number(value, name, "report", self._warned)
                if checked is not None:
                    fields[name] = checked
        self._trimmer.step_ended()
        if "batch_size" in fields:
            self._send_later("report", fields)

    def report_oom(self, batch_size: int) -> None:
        """Tell the daemon a step ran out of memory; waits (within ``timeout``) for the new plan.

        If the daemon does not answer, the session backs off locally (25 % smaller) so the very
        next ``plan()`` is smaller anyway, and the OOM is delivered when the daemon is back.
        """
        batch_size = wire_number(batch_size, "batch_size", "report_oom", self._warned)
        if batch_size is None:  # an OOM still happened: at the planned batch, most likely
            batch_size = self._plan.batch_size if self._plan is not None else self.default_batch or self.min_batch
        if not self._lock.acquire(timeout=self.timeout):
            self._local_oom(batch_size)
            return
        try:
            self._check_fork()
            now = time.monotonic()
            deadline = now + self.timeout
            try:
                if now < self._retry_at:
                    raise NoReply("backing off")
                self._ensure_session(deadline)
                result = self._call("oom", deadline, token=self._token, batch_size=batch_size)
                self._accept(result)
                self._ceiling = None
            except (NoReply, ErrorReply):
                self._failed()
                self._local_oom(batch_size)
                self._pending.append(("oom", {"batch_size": batch_size}))
        except Exception:
            self._local_oom(batch_size)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Say goodbye (without waiting) and release the socket."""
        if not self._lock.acquire(timeout=max(self.timeout, 1.0)):
            return
        try:
            if self._sock is not None and self._pid == os.getpid():
                if self._token is not None:
                    try:
                        self._sock.send(protocol.encode(protocol.request("bye", self._next_id(), token=self._token)),
                                        zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # queue full or daemon gone: it expires the session by itself
                # destroy() closes the socket even when the send failed: term() alone would wait forever.
                if self._ctx is not None:  # always, beside a socket
                    self._ctx.destroy(linger=int(self.timeout * 1000))
            self._reset()
        finally:
            self._lock.release()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __reduce__(self) -> Tuple[Callable[[Optional[str], Dict[str, Any]], Session], Tuple[Any, ...]]:
        # A Session sent to a spawned worker arrives as a fresh, unconnected copy.
        kwargs = dict(endpoint=self.endpoint, timeout=self.timeout, min_batch=self.min_batch,
                      max_batch=self.max_batch, default_batch=self.default_batch,
                      target_effective_batch=self.target_effective_batch, device=self.device,
                      hints=self.hints, server_key=self.server_key, client_key_file=self.client_key_file)
        return (_rebuild, (self.job, kwargs))

    # -- internals --------------------------------------------------------------------------

    def _reset(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()  # closed by close(), or a forked child's copy of the parent's socket: not ours
        self._finalizer = None
        self._pid = os.getpid()
        self._ctx = None
        self._sock = None
        self._rcvtimeo = 0
        self._fresh_socket = False
        self._token = None
        # This Session's secret for the daemon: a hello retried after its reply was lost finds the
        # session the first one opened, instead of opening a second that halves the job's share.
        self._nonce = secrets.token_urlsafe(24)
        self._plan: Optional[Plan] = None
        self._plan_expires = 0.0
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST
        self._ids = 0
        self._ceiling = None
        self._pending: Deque[Tuple[str, Dict[str, Any]]] = collections.deque(maxlen=_PENDING_REPORTS)
        self._suggested: Optional[int] = None  # suggest_batch's last batch, not yet reported
        self._last_suggested: Optional[int] = None  # suggest_batch's last answer
        self._trimmer = StepTrimmer(limit=self.timeout)

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._reset()  # the parent's socket is not ours; pyzmq will not close it here either

    def _ensure_session(self, deadline: float) -> None:
        if self._token is not None:
            return
        self._drain()  # the reply to a hello that timed out may be here by now: its token is ours
        if self._token is None:
            result = self._call("hello", deadline, **self._hello_fields())
            token = result.get("token") if isinstance(result, dict) else None
            if not isinstance(token, str):
                raise NoReply("hello reply carried no token")
            self._token = token
            self._accept(result)
        self._flush_pending()

    def _hello_fields(self) -> Dict[str, Any]:
        fields: Dict[str, Any] = {
            "job": self.job, "pid": os.getpid(), "host": socket.gethostname(),
            "min_batch": self.min_batch, "hints": self.hints, "nonce": self._nonce,
        }
        for name in ("max_batch", "default_batch", "target_effective_batch"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self._plan is not None and self._plan.source == "daemon":
            fields["batch_size"] = self._plan.batch_size  # hello again, running: the daemon restarted
        fields.update(distributed_identity())
        fields.update(process_identity())
        fields.update(scheduler_identity())
        fields.update(device_identity(self.device))
        cpus = usable_cpus()
        if cpus:
            fields["cpus"] = cpus
        return fields

    def _absorb(self, reply: Dict[str, Any]) -> None:
        """Learn from a reply nobody waits for: a token, a newer plan."""
        result = reply.get("result")
        if reply.get("ok") is True and isinstance(result, dict):
            if self._token is None and isinstance(result.get("token"), str):
                self._token = result["token"]  # a hello that timed out earlier did succeed
            if "plan" in result:
                try:
                    self._accept(result, late=True)
                except ValueError:
                    pass

    def _accept(self, result: Dict[str, Any], late: bool = False) -> None:
        """Take the plan a reply carries. A ``late`` one (a reply drained after the fact, made
        when the daemon handled an earlier report) replaces the plan but does not extend its
        freshness: how long ago it was made is unknown."""
        if "plan" not in result:
            return
        asked = self.hints.get("num_workers")
        workers = asked if isinstance(asked, int) else max(1, usable_cpus() or 1)
        plan = within_limits(Plan.from_wire(result["plan"], source="daemon"), self.min_batch, self.max_batch,
                             self.target_effective_batch, workers)
        self._plan = plan
        if not late:
            self._plan_expires = time.monotonic() + plan.fresh_for

    def _send_later(self, op: str, fields: Dict[str, Any]) -> None:
        if not self._lock.acquire(timeout=self.timeout):
            return  # another thread holds the session; a lost report only slows learning
        try:
            self._check_fork()
            if self._token is None or self._sock is None:
                self._pending.append((op, fields))
                return
            self._drain()
            self._flush_pending()
            if not self._try_send(op, fields):
                self._pending.append((op, fields))
        except Exception:
            pass
        finally:
            self._lock.release()

    def _flush_pending(self) -> None:
        while self._pending and self._token is not None:
            op, fields = self._pending[0]
            if not self._try_send(op, fields):
                return
            self._pending.popleft()

    def _step_done(self) -> None:
        """suggest_batch's implicit report: the step since its last call ran at the batch it
        suggested then (one the daemon made: a fallback step was never the daemon's to
        measure), and the daemon measures what it cost."""
        if self._suggested is not None:
            batch, self._suggested = self._suggested, None
            self.report(batch)

    def _failed(self) -> None:
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX)

    def _local_oom(self, batch_size: int) -> None:
        cut = max(self.min_batch, (batch_size * 3) // 4)
        self._ceiling = cut if self._ceiling is None else min(self._ceiling, cut)
        self._plan_expires = 0.0  # the next plan() asks again, or falls back below the ceiling

    def _fallback(self, reason: str) -> Plan:
        max_batch = self.max_batch
        if self._ceiling is not None:
            max_batch = self._ceiling if max_batch is None else min(max_batch, self._ceiling)
            reason += "; backed off to %d after an out-of-memory error" % self._ceiling
        return fallback_plan(
            min_batch=self.min_batch, max_batch=max_batch, default_batch=self.default_batch,
            target_effective_batch=self.target_effective_batch, hints=self.hints, reason=reason, base=self._plan,
            cpus=usable_cpus())


def _rebuild(job: Optional[str], kwargs: Dict[str, Any]) -> Session:
    return Session(job, **kwargs)


def _curve_keys(server_key: Optional[str], client_key_file: Optional[str],
                warned: Set[object]) -> Tuple[Optional[curve.ClientKeys], Optional[str]]:
    """(CURVE keys or None, why the environment's keys cannot be used or None). Keys passed as
    arguments are the caller's own: a bad one raises ValueError here, before training starts.
    Keys from the environment (MEMD_SERVER_KEY, MEMD_CLIENT_KEY_FILE) may be one node's slip:
    the session then plans locally, says why in each fallback plan and warns once."""
    try:
        return curve.client_keys(server_key, client_key_file), None
    except ValueError as exc:
        if server_key or client_key_file:
            raise
        warn_once(warned, "curve", "memd: %s; planning locally", exc)
        return None, str(exc)


def _after_fork_in_child() -> None:
    for session in list(_sessions):
        session._lock = threading.Lock()  # a lock held by another thread at fork stays held forever
        session._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


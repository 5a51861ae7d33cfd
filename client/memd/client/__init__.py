"""memd's client: ask the local memd daemon which batch size to use now.

    from memd import client
    bs = client.suggest_batch(default=32)            # an int, always; never raises

    with client.Session(job="llama-ft", target_effective_batch=64, max_batch=128) as s:
        plan = s.plan()
        s.report(batch_size=plan.batch_size, peak_bytes=torch.cuda.max_memory_reserved())

No call blocks longer than ``timeout`` (50 ms by default) and none raises because the daemon is
absent, slow, restarting or answering garbage: the plan then comes from a local fallback
(``plan.source == "fallback"``) and the session reconnects by itself later. This module
imports pyzmq and msgpack and nothing of the daemon's.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import operator
import os
import secrets
import socket
import sys
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Set, Tuple

import zmq

from . import curve, protocol
from .heap import StepTrimmer, steady_heap, trim_heap
from .plan import Plan, fallback_plan, split_batch, within_limits

__all__ = ["Plan", "Session", "suggest_batch", "session", "split_batch", "call", "DaemonUnavailable", "Refused",
           "trim_heap", "steady_heap"]

# Plain ints: pyzmq's enum flags cost a conversion per call, and these are on the hot path.
_NOBLOCK, _EVENTS, _POLLIN, _RCVTIMEO = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVTIMEO)

_BACKOFF_FIRST = 0.1  # seconds before the first retry after the daemon failed to answer
_BACKOFF_MAX = 2.0
_PENDING_REPORTS = 16  # reports kept while the daemon cannot take them; older ones are dropped
_MAX_HINTS = 32

log = logging.getLogger("memd.client")


class _Unavailable(Exception):
    """The daemon did not answer in time, or could not be reached at all."""


class _Refused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__("%s: %s" % (code, message))
        self.code = code


_sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()


class Session:
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
        self.job = (str(job) if job is not None else _default_job())[:128]  # the daemon takes 128 characters
        self.endpoint = endpoint or protocol.default_endpoint()
        self.timeout = float(timeout)
        if not self.timeout > 0:
            raise ValueError("timeout must be a positive number of seconds, not %r" % (timeout,))
        self._timeout_ms = max(1, int(self.timeout * 1000))
        self.min_batch = _count(min_batch, "min_batch")
        self.max_batch = _optional_count(max_batch, "max_batch")
        self.default_batch = _optional_count(default_batch, "default_batch")
        self.target_effective_batch = _optional_count(target_effective_batch, "target_effective_batch")
        if self.max_batch is not None and self.max_batch < self.min_batch:
            raise ValueError("max_batch (%d) is below min_batch (%d)" % (self.max_batch, self.min_batch))
        if self.target_effective_batch is not None and self.target_effective_batch < self.min_batch:
            raise ValueError("target_effective_batch (%d) is below min_batch (%d)"
                             % (self.target_effective_batch, self.min_batch))
        self.device = device
        self._warned: Set[object] = set()  # what this session already warned about: once is enough
        if num_workers is not None:  # the workers the job would like: memory and pressure only cut from there
            hints = dict(hints or {}, num_workers=_count(num_workers, "num_workers", allow_zero=True))
        self.hints = _clean_hints(hints, self._warned)
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
            except _Refused as exc:
                if exc.code != protocol.UNKNOWN_SESSION:
                    self._failed()
                    return self._fallback("daemon refused (%s)" % (exc,))
            except _Unavailable as exc:
                self._failed()
                return self._fallback("daemon unavailable (%s)" % (exc,))
            try:  # the daemon restarted or expired us: register again within the same deadline
                return self._ask_plan(deadline)
            except (_Unavailable, _Refused) as exc:
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
            raise _Unavailable("the daemon's reply carried no plan")
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
                checked = _wire_number(value, name, "report", self._warned)
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
        batch_size = _wire_number(batch_size, "batch_size", "report_oom", self._warned)
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
                    raise _Unavailable("backing off")
                self._ensure_session(deadline)
                result = self._call("oom", deadline, token=self._token, batch_size=batch_size)
                self._accept(result)
                self._ceiling = None
            except (_Unavailable, _Refused):
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
        self._pid = os.getpid()
        self._ctx: Optional[zmq.SyncContext] = None
        self._sock: Optional[zmq.SyncSocket] = None
        self._rcvtimeo = 0
        self._fresh_socket = False
        self._token: Optional[str] = None
        # This Session's secret for the daemon: a hello retried after its reply was lost finds the
        # session the first one opened, instead of opening a second that halves the job's share.
        self._nonce = secrets.token_urlsafe(24)
        self._plan: Optional[Plan] = None
        self._plan_expires = 0.0
        self._retry_at = 0.0
        self._backoff = _BACKOFF_FIRST
        self._ids = 0
        self._ceiling = None
        self._pending: Deque[Tuple[str, Dict[str, Any]]] = collections.deque(maxlen=_PENDING_REPORTS)
        self._suggested: Optional[int] = None  # suggest_batch's last batch, not yet reported
        self._last_suggested: Optional[int] = None  # suggest_batch's last answer
        self._trimmer = StepTrimmer(limit=self.timeout)

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            self._reset()  # the parent's socket is not ours; pyzmq will not close it here either

    def _next_id(self) -> int:
        self._ids = (self._ids + 1) & 0x7FFFFFFF
        return self._ids

    def _socket(self) -> zmq.SyncSocket:
        if self._sock is None:
            why = protocol.stranger(self.endpoint)
            if why:
                raise _Unavailable("%s: not trusted" % why)
            if self._curve_problem:
                raise _Unavailable(self._curve_problem)
            self._ctx = zmq.Context(io_threads=1)
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing toward a daemon that is not there
            sock.setsockopt(zmq.SNDHWM, 64)
            sock.setsockopt(zmq.RCVHWM, 64)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            self._rcvtimeo = self._timeout_ms
            sock.setsockopt(zmq.RCVTIMEO, self._rcvtimeo)  # a blocking recv is one call; poll + recv two
            if self._curve is not None:
                self._curve.apply(sock)
            sock.connect(self.endpoint)
            self._sock = sock
            self._fresh_socket = True
        return self._sock

    def _ensure_session(self, deadline: float) -> None:
        if self._token is not None:
            return
        self._drain()  # the reply to a hello that timed out may be here by now: its token is ours
        if self._token is None:
            result = self._call("hello", deadline, **self._hello_fields())
            token = result.get("token") if isinstance(result, dict) else None
            if not isinstance(token, str):
                raise _Unavailable("hello reply carried no token")
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
        fields.update(_distributed_identity())
        fields.update(_process_identity())
        fields.update(_scheduler_identity())
        fields.update(_device_identity(self.device))
        cpus = usable_cpus()
        if cpus:
            fields["cpus"] = cpus
        return fields

    def _call(self, op: str, deadline: float, **fields: Any) -> Dict[str, Any]:
        """One round trip bounded by ``deadline``; replies to earlier requests are absorbed."""
        sock = self._socket()
        if self._rcvtimeo != self._timeout_ms:  # an earlier call's last round waited less
            self._rcvtimeo = self._timeout_ms
            sock.setsockopt(_RCVTIMEO, self._rcvtimeo)
        request_id = self._next_id()
        self._send(sock, protocol.request(op, request_id, **fields), deadline)
        while True:
            remaining = int((deadline - time.monotonic()) * 1000)
            if remaining <= 0:
                raise _Unavailable("no reply to %s within %.0f ms" % (op, self.timeout * 1000))
            if remaining < self._rcvtimeo:  # later rounds (a stale reply came first) wait less
                sock.setsockopt(_RCVTIMEO, remaining)
                self._rcvtimeo = remaining
            try:
                data = sock.recv()  # blocks at most RCVTIMEO
            except zmq.Again:
                raise _Unavailable("no reply to %s within %.0f ms" % (op, self.timeout * 1000)) from None
            reply = _decoded(data)
            if reply is None:
                continue
            if reply.get("id") != request_id:
                self._absorb(reply)
                continue
            result = reply.get("result")
            if reply.get("ok") is True and isinstance(result, dict):
                self._backoff = _BACKOFF_FIRST
                return result
            error = reply.get("error")
            if not isinstance(error, dict):
                error = {}
            code = str(error.get("code", "bad_reply"))
            if code == protocol.UNKNOWN_SESSION:
                self._token = None  # the daemon restarted or expired us: hello again
            raise _Refused(code, str(error.get("message", ""))[:200])

    def _send(self, sock: zmq.SyncSocket, message: Dict[str, Any], deadline: float) -> None:
        data = protocol.encode(message)
        try:
            sock.send(data, _NOBLOCK)
            return
        except zmq.Again:
            pass
        # A socket that has just connected may still be completing its handshake: wait for it,
        # but only then; later an Again means nobody is listening, and that is known at once.
        if self._fresh_socket:
            self._fresh_socket = False
            remaining = deadline - time.monotonic()
            if remaining > 0 and sock.poll(int(remaining * 1000), zmq.POLLOUT):
                try:
                    sock.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
        raise _Unavailable("daemon not connected at %s%s" % (self.endpoint, "; " + curve.HINT if self._curve else ""))

    def _receive(self, sock: zmq.SyncSocket) -> None:
        """Read one waiting reply, if any, and absorb what it teaches."""
        try:
            reply = _decoded(sock.recv(_NOBLOCK))
        except zmq.Again:
            return
        if reply is not None:
            self._absorb(reply)

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

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(256):
            # pyzmq types every option int | bytes; EVENTS is an int. Cheaper than poll(0) on the hot path.
            if not sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
                return
            self._receive(sock)

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

    def _try_send(self, op: str, fields: Dict[str, Any]) -> bool:
        try:
            if self._sock is None:
                return False
            message = protocol.request(op, self._next_id(), token=self._token, **fields)
            self._sock.send(protocol.encode(message), _NOBLOCK)
            return True
        except zmq.Again:
            return False

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


def _decoded(data: bytes) -> Optional[Dict[str, Any]]:
    """A reply as a map; None for anything else (garbage is skipped, never raised)."""
    try:
        reply = protocol.decode(data)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


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
        _warn_once(warned, "curve", "memd: %s; planning locally", exc)
        return None, str(exc)


def _after_fork_in_child() -> None:
    for session in list(_sessions):
        session._lock = threading.Lock()  # a lock held by another thread at fork stays held forever
        session._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _optional_count(value: Any, name: str) -> Optional[int]:
    return None if value is None else _count(value, name)


def _count(value: Any, name: str, allow_zero: bool = False) -> int:
    try:
        number = operator.index(value) if not isinstance(value, float) else int(value)
    except TypeError:
        raise TypeError("%s must be an integer, not %r" % (name, value)) from None
    except (ValueError, OverflowError):  # a NaN or an infinity
        raise ValueError("%s must be a finite count, not %r" % (name, value)) from None
    if isinstance(value, bool) or number < (0 if allow_zero else 1):
        raise ValueError("%s must be %s, not %r" % (name, "a count >= 0" if allow_zero else "a count >= 1", value))
    high = protocol.FIELD_RANGES.get(name, (0, number))[1]  # the daemon would refuse more (docs/protocol.md)
    if number > high:
        raise ValueError("%s must be at most %d, not %d" % (name, high, number))
    return number


def _wire_number(value: Any, name: str, call: str, warned: Set[object]) -> Any:
    """``value`` as the protocol's field ``name`` takes it (an int; a float for step_seconds),
    or None, with a warning once per ``warned`` set, when it is not a finite number in the field's
    range: the training loop that handed it over must not die of it, and the daemon would
    refuse it."""
    low, high = protocol.FIELD_RANGES[name]
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        if name == "step_seconds":
            number = float(value)
        elif isinstance(value, float):
            number = int(value)  # NaN: ValueError; an infinity: OverflowError
        else:
            number = operator.index(value)
        if not low <= number <= high:  # False for NaN too
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        _warn_once(warned, (call, name), "memd: %s(%s=%.60r) left out: not a number in [%d, %d]",
                   call, name, value, low, high)
        return None
    return number


def _warn_once(warned: Set[object], key: Any, message: str, *args: Any) -> None:
    if key not in warned and len(warned) < 1024:
        warned.add(key)
        log.warning(message, *args)


def _clean_hints(hints: Optional[Dict[str, Any]], warned: Set[object]) -> Dict[str, Any]:
    """Keep hints small and plain (str keys, scalar values) so they always fit the wire, and
    within protocol.HINT_RANGES: the daemon would ignore the rest anyway."""
    if not hints:
        return {}
    if not isinstance(hints, dict):
        raise TypeError("hints must be a dict, not %r" % (type(hints).__name__,))
    clean: Dict[str, Any] = {}
    for key, value in list(hints.items())[:_MAX_HINTS]:
        if isinstance(value, (bool, int, float, str)) or value is None:
            key = str(key)[:64]
            problem = protocol.hint_problem(key, value)
            if problem is not None:
                _warn_once(warned, ("hints", key), "memd: %s; not sent", problem)
                continue
            clean[key] = value[:256] if isinstance(value, str) else value
    return clean


def usable_cpus() -> Optional[int]:
    """CPUs this process may run on (its affinity), shared among the job's ranks on this node."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 0
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, cpus // int(ranks)) if ranks.isdigit() and int(ranks) > 0 and cpus else (cpus or None)


def _default_job(argv: Optional[List[str]] = None, main: Any = None, orig_argv: Optional[List[str]] = None) -> str:
    """The name a job's curves are kept under when it gives none: its script's file name
    (``train.py``); under ``python -m`` the module's name (``pkg.train``, a package's
    ``__main__`` named by its package: argv[0] is then the module's full path, not a name);
    under ``python -c`` "python-c:" and a hash of the command, so that one command run again
    finds what it learned and two different ones do not share a curve ("python-c" where Python
    keeps no copy of the command, before 3.10); "python" at the interactive prompt. Never "-c":
    every one-liner on a machine would share one curve under it."""
    argv = sys.argv if argv is None else argv
    main = sys.modules.get("__main__") if main is None else main
    first = argv[0] if argv else ""
    spec = getattr(main, "__spec__", None)
    module = getattr(spec, "name", None)
    if isinstance(module, str) and module and module != "__main__":  # python -m
        if module.endswith(".__main__"):
            module = module[:-len(".__main__")]
        return module
    if first == "-c":
        orig = getattr(sys, "orig_argv", None) if orig_argv is None else orig_argv
        command = orig[orig.index("-c") + 1] if orig and "-c" in orig[:-1] else None
        if command is None:
            return "python-c"
        return "python-c:%s" % hashlib.sha256(command.encode("utf-8", "replace")).hexdigest()[:12]
    name = os.path.basename(first) if first not in ("", "-") else ""
    return name or "python"


def _process_identity(proc_root: str = "/proc") -> Dict[str, Any]:
    """This process's pid namespace (the inode of /proc/self/ns/pid) and start time (clock
    ticks since boot, field 22 of /proc/self/stat), each left out when unreadable (not Linux).
    The daemon watches the hello's pid only when both match what it reads for that pid: in a
    container sharing the host's name, the pid names an unrelated process in the daemon's view."""
    fields: Dict[str, Any] = {}
    try:
        fields["pid_ns"] = os.stat(os.path.join(proc_root, "self", "ns", "pid")).st_ino
    except OSError:
        pass
    try:
        with open(os.path.join(proc_root, "self", "stat")) as f:
            fields["start_time"] = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        pass
    return {name: value for name, value in fields.items()
            if protocol.FIELD_RANGES[name][0] <= value <= protocol.FIELD_RANGES[name][1]}


def _scheduler_identity(proc_root: str = "/proc", environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The Slurm job (SLURM_JOB_ID) and Kubernetes pod (its UID, from this process's cgroup or
    mounts) this process runs in, for `memd status` and the session metrics. The daemon reads
    them itself from a process it can watch; these count for one it cannot (another pid
    namespace, another host), shown there as told by the client."""
    env = os.environ if environ is None else environ
    fields: Dict[str, Any] = {}
    slurm = env.get("SLURM_JOB_ID", "")
    if protocol.SLURM_JOB_ID.match(slurm):
        fields["slurm_job_id"] = slurm
    pod = None
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as f:
            pod = protocol.pod_uid_in(f.read(1 << 16))  # cgroup v1, or v2 without a cgroup namespace
        if pod is None:  # kubelet bind-mounts the pod's /etc/hosts from /var/lib/kubelet/pods/<UID>/
            with open(os.path.join(proc_root, "self", "mountinfo")) as f:
                for line in f:
                    parts = line.split(" ", 5)
                    if len(parts) > 4 and parts[4] == "/etc/hosts":
                        pod = protocol.pod_uid_in(parts[3])
                        break
    except (OSError, UnicodeDecodeError):
        pass
    if pod is not None:
        fields["pod_uid"] = pod
    return fields


def _distributed_identity() -> Dict[str, Any]:
    fields: Dict[str, Any] = {}
    for name, env in (("rank", "RANK"), ("local_rank", "LOCAL_RANK"), ("world_size", "WORLD_SIZE"),
                      ("local_world_size", "LOCAL_WORLD_SIZE")):
        value = os.environ.get(env)
        if value is not None and value.isdigit():
            fields[name] = int(value)
    return fields


def _device_identity(device: Any) -> Dict[str, Any]:
    """The device as given, plus its UUID when torch (already imported by the caller) knows it.

    NVML and CUDA number devices differently (CUDA_VISIBLE_DEVICES, MIG), so the daemon maps a
    device by UUID and only falls back to the index when no UUID is known.
    """
    fields: Dict[str, Any] = {}
    if device is not None:
        fields["device"] = str(device)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        fields["cuda_visible_devices"] = visible[:256]
    torch = sys.modules.get("torch")
    if torch is None:
        return fields
    try:
        if not torch.cuda.is_initialized():
            return fields
        if device is None:
            index = torch.cuda.current_device()
        else:
            dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
            if dev.type != "cuda":
                return fields
            index = dev.index if dev.index is not None else torch.cuda.current_device()
        fields.setdefault("device", "cuda:%d" % index)
        fields["device_uuid"] = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        pass
    return fields


_process_session: Optional[Session] = None
_process_session_pid = 0
_process_lock = threading.Lock()


def suggest_batch(default: int, **session_kwargs: Any) -> int:
    """The batch size to use now, as an int; ``default`` if anything at all goes wrong.

    Call it once per training step. Each call after the first tells the daemon that the step
    since the last call ran clean at the batch it suggested then, and the daemon measures what
    that step cost (the job's peak memory since the previous call), so the suggestions follow
    the job's real memory curve with no report from the caller. When the answer changes, the C
    heap's free pages go back to the kernel first (``trim_heap``), so the new batch is not
    charged for the old one's. One Session is created lazily per process (the first call's
    keyword arguments configure it); ``memd.client.session()`` returns it, to report an
    out-of-memory error with ``report_oom``.
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
    if isinstance(default, int) and not isinstance(default, bool) and default >= 1:
        return default
    if isinstance(default, float) and default.is_integer() and default >= 1:
        return int(default)
    _warn_once(_suggest_warned, ("default", repr(default)[:64]), "memd: suggest_batch(default=%r) is not a whole "
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


class DaemonUnavailable(Exception):
    """``call`` got no usable reply (absent, too slow, or refused)."""


class Refused(DaemonUnavailable):
    """The daemon answered ``call`` with an error: ``code`` is the protocol's (``invalid``...)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def call(op: str, endpoint: Optional[str] = None, timeout: float = 1.0, *, server_key: Optional[str] = None,
         client_key_file: Optional[str] = None, **fields: Any) -> Dict[str, Any]:
    """One request and its reply, for tools such as ``memd status``; raises DaemonUnavailable.

    ``server_key``, ``client_key_file``: CURVE keys as for Session (else MEMD_SERVER_KEY and
    MEMD_CLIENT_KEY_FILE). Training loops should use Session, which never raises; this is the
    plain primitive.
    """
    endpoint = endpoint or protocol.default_endpoint()
    why = protocol.stranger(endpoint)
    if why:
        raise DaemonUnavailable("%s: not trusted" % why)
    try:
        keys = curve.client_keys(server_key, client_key_file)
    except ValueError as exc:
        raise DaemonUnavailable(str(exc)) from None
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
    if path and not path.startswith("@") and not os.path.exists(path):
        raise DaemonUnavailable("no daemon socket at %s" % path)
    ctx: zmq.SyncContext = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if keys is not None:
            keys.apply(sock)
        sock.connect(endpoint)
        deadline = time.monotonic() + timeout
        sock.send(protocol.encode(protocol.request(op, 1, **fields)))
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000), zmq.POLLIN):
                raise DaemonUnavailable("no daemon answered at %s within %.1f s%s"
                                        % (endpoint, timeout, " (%s)" % curve.HINT if keys else ""))
            try:
                reply = protocol.decode(sock.recv())
            except ValueError as exc:
                raise DaemonUnavailable("unreadable reply from %s: %s" % (endpoint, exc)) from None
            if isinstance(reply, dict) and reply.get("id") == 1:
                break
        result = reply.get("result")
        if reply.get("ok") is True and isinstance(result, dict):
            return result
        error = reply.get("error")
        if not isinstance(error, dict):
            error = {}
        raise Refused("%s refused %s: %s" % (endpoint, op, error.get("message", error.get("code", "?"))),
                      str(error.get("code", "?")))
    except zmq.ZMQError as exc:
        raise DaemonUnavailable("cannot reach %s: %s" % (endpoint, exc)) from None
    finally:
        sock.close(0)

"""The socket half of a Session: one DEALER toward the daemon, round trips bounded by a deadline,
sends that never block, and replies nobody waits for read when they are there.

A mixin, so that the hot path (a cached ``plan()`` draining its socket) stays one attribute
look-up away; the Session supplies the state it works on and ``_absorb`` for stray replies.
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Dict, Optional

import zmq

from . import curve, protocol

# Plain ints: pyzmq's enum flags cost a conversion per call, and these are on the hot path.
_NOBLOCK, _EVENTS, _POLLIN, _RCVTIMEO = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVTIMEO)

BACKOFF_FIRST = 0.1  # seconds before the first retry after the daemon failed to answer


def release(ctx: zmq.SyncContext, sock: zmq.SyncSocket) -> None:
    """Close a collected Session's socket, then its context (see Transport._socket)."""
    sock.close(0)
    ctx.term()


class NoReply(Exception):
    """The daemon did not answer in time, or could not be reached at all."""


class ErrorReply(Exception):
    """The daemon answered with an error: ``code`` is the protocol's."""

    def __init__(self, code: str, message: str):
        super().__init__("%s: %s" % (code, message))
        self.code = code


class Transport:
    """Owns ``_sock`` (and its context) for the Session it is mixed into."""

    endpoint: str
    timeout: float
    _timeout_ms: int
    _curve: Optional[curve.ClientKeys]
    _curve_problem: Optional[str]
    _ctx: Optional[zmq.SyncContext]
    _sock: Optional[zmq.SyncSocket]
    _finalizer: Optional[weakref.finalize[Any, Any]]  # closes both if the Session is collected unclosed
    _rcvtimeo: int
    _fresh_socket: bool
    _token: Optional[str]
    _ids: int
    _backoff: float

    def _absorb(self, reply: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _next_id(self) -> int:
        self._ids = (self._ids + 1) & 0x7FFFFFFF
        return self._ids

    def _socket(self) -> zmq.SyncSocket:
        if self._sock is None:
            why = protocol.stranger(self.endpoint)
            if why:
                raise NoReply("%s: not trusted" % why)
            if self._curve_problem:
                raise NoReply(self._curve_problem)
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
            # A Session dropped unclosed inside a reference cycle (a Trainer holding its callback)
            # is collected by gc, which runs the Context's __del__ with the socket still open:
            # zmq_ctx_term then waits for it forever. This closes both first, from references
            # of its own (gc has already emptied the Context's weak set of sockets by then).
            self._finalizer = weakref.finalize(self, release, self._ctx, sock)
            self._finalizer.atexit = False  # at exit pyzmq lets both go by itself
        return self._sock

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
                raise NoReply("no reply to %s within %.0f ms" % (op, self.timeout * 1000))
            if remaining < self._rcvtimeo:  # later rounds (a stale reply came first) wait less
                sock.setsockopt(_RCVTIMEO, remaining)
                self._rcvtimeo = remaining
            try:
                data = sock.recv()  # blocks at most RCVTIMEO
            except zmq.Again:
                raise NoReply("no reply to %s within %.0f ms" % (op, self.timeout * 1000)) from None
            reply = decoded(data)
            if reply is None:
                continue
            if reply.get("id") != request_id:
                self._absorb(reply)
                continue
            result = reply.get("result")
            if reply.get("ok") is True and isinstance(result, dict):
                self._backoff = BACKOFF_FIRST
                return result
            error = reply.get("error")
            if not isinstance(error, dict):
                error = {}
            code = str(error.get("code", "bad_reply"))
            if code == protocol.UNKNOWN_SESSION:
                self._token = None  # the daemon restarted or expired us: hello again
            raise ErrorReply(code, str(error.get("message", ""))[:200])

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
        raise NoReply("daemon not connected at %s%s" % (self.endpoint, "; " + curve.HINT if self._curve else ""))

    def _receive(self, sock: zmq.SyncSocket) -> None:
        """Read one waiting reply, if any, and absorb what it teaches."""
        try:
            reply = decoded(sock.recv(_NOBLOCK))
        except zmq.Again:
            return
        if reply is not None:
            self._absorb(reply)

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(256):
            # pyzmq types every option int | bytes; EVENTS is an int. Cheaper than poll(0) on the hot path.
            if not sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
                return
            self._receive(sock)

    def _try_send(self, op: str, fields: Dict[str, Any]) -> bool:
        try:
            if self._sock is None:
                return False
            message = protocol.request(op, self._next_id(), token=self._token, **fields)
            self._sock.send(protocol.encode(message), _NOBLOCK)
            return True
        except zmq.Again:
            return False


def decoded(data: bytes) -> Optional[Dict[str, Any]]:
    """A reply as a map; None for anything else (garbage is skipped, never raised)."""
    try:
        reply = protocol.decode(data)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None

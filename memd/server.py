"""The ZeroMQ ROUTER loop: decode -> validate -> handler -> reply.

Only this module (with zap.py, its CURVE allow-list) and the client touch zmq. It adds the
reply envelope, maps exceptions to error codes in one place (a handler's Invalid is the
client's fault, anything else the daemon's: ``internal``, its traceback logged at most once a
minute per op and error), and never blocks: replies are sent without waiting (a peer that does
not read its replies loses them, it does not stall the daemon). Messages over the protocol cap
get a ``too_large`` reply; messages over four times the cap are dropped by libzmq itself
(ZMQ_MAXMSGSIZE), which disconnects the sender.
ZMQ_MAXMSGSIZE caps a frame, not a message, so frames beyond the protocol's (MAX_FRAMES) are
received without a copy and dropped, never echoed, and each peer's queue holds at most RCVHWM
messages (docs/protocol.md, "Envelope"). What libzmq holds before a message is whole, and how
many connections it keeps, the guard bounds (guard.py).
"""
from __future__ import annotations

import errno
import math
import os
import stat
import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional

import structlog
import zmq

from memd import loopback
from memd.client import protocol
from memd.client.counts import whole
from memd.client.heap import trim_heap
from memd.config import ConfigError
from memd.guard import MAX_CONNECTIONS, Guard, descriptor
from memd.logs import Throttle
from memd.ops import Invalid
from memd.sessions import Peer, TooManySessions, UnknownSession
from memd.zap import DOMAIN, Gate

log = structlog.get_logger("memd.server")

Handler = Callable[[Dict[str, Any]], Dict[str, Any]]
Observer = Callable[[str, str, float], None]
BATCH = 256  # messages handled per poll before returning to the daemon's housekeeping
MAX_FRAMES = 3  # the peer's identity, a REQ socket's empty delimiter, the body
# Messages queued per peer while the daemon is busy: a client has a plan and at most 16 reports
# in flight; 1000 let 8 peers park 1.9 GB in a stall.
RCVHWM = 64
# Replies queued per peer that does not read them (beyond, ROUTER drops them): with 255 sessions a
# status reply is 187 KB, and 1000 let each such peer park 187 MB in the daemon (4 peers: 796 MB).
SNDHWM = 64
TRIM_AFTER = 1 << 20  # bytes of dropped frames after which the C heap is trimmed (at most once a second)
_NOBLOCK, _EVENTS, _POLLIN, _RCVMORE = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
_SNDMORE = int(zmq.SNDMORE)


def peer_of(address: Optional[str]) -> Optional[Peer]:
    """libzmq's Peer-Address of an ipc connection ends ``:uid:gid:pid`` (``:uid:gid:`` on BSD and
    macOS); over TCP it is an address and says nothing of the sender: None."""
    parts = (address or "").rsplit(":", 3)
    if len(parts) != 4 or not parts[1].isdigit():
        return None
    return Peer(int(parts[1]), int(parts[3]) if parts[3].isdigit() else None)


class Server:
    def __init__(self, endpoint: str, dispatch: Dict[str, Handler], observe: Optional[Observer] = None,
                 curve_secret_key: Optional[bytes] = None, socket_mode: int = 0o660,
                 throttle: Optional[Throttle] = None, client_keys: Optional[FrozenSet[bytes]] = None,
                 max_connections: int = MAX_CONNECTIONS):
        self.endpoint = endpoint
        self.max_connections = max_connections
        self.guard: Optional[Guard] = None  # made with the socket, before it binds
        self.received = 0  # messages taken from the socket, ever (the guard's rounds)
        self._waking = False  # whether the poller waits on the guard's wakers (it is idle)
        self._zap_sock: Optional[zmq.Socket] = None
        self._caught_up = False  # the socket was found empty since the guard's last look
        self.throttle = throttle or Throttle(interval=60.0)  # one traceback a minute per op and error
        self.dispatch = dispatch
        self.observe = observe or (lambda op, outcome, seconds: None)
        self.curve_secret_key = curve_secret_key
        self.socket_mode = socket_mode
        self.context = zmq.Context(io_threads=1)
        # CURVE never without its allow-list (zap.py): no keys given admits nobody, not everybody.
        self.zap = Gate(self.context, client_keys or frozenset()) if curve_secret_key is not None else None
        self.sock: Optional[zmq.SyncSocket] = None
        self._ipc_path: Optional[str] = None
        self._dropped_bytes = 0  # in frames dropped since the heap was last trimmed
        self._trim_at = 0.0  # monotonic time before which it is not trimmed again
        # The first frame of the message being handled, whose properties name its sender (peer);
        # and whether its CURVE key has been taken off the allow-list since it connected.
        self._first: Optional[zmq.Frame] = None
        self.revoked = False
        # The sender's CURVE public key (Z85), as the allow-list admitted it: who a remote job is
        # (its curves and its share of the slots are that key's); None without CURVE.
        self.key: Optional[str] = None
        self.loopback = loopback.Peers()  # who each loopback TCP connection's owner is, per connection

    @property
    def peer(self) -> Optional[Peer]:
        """The sender of the message being handled, in the kernel's word: the ipc socket's
        credentials, or a loopback TCP connection's owner (memd.loopback, by the message's SRCFD);
        None where neither tells. For handlers that must know who asks (hello); valid only while
        a handler runs. Read when asked: parsing it for every message cost a report more than
        the hello that needs it."""
        return self.sender()

    def sender(self, pid: bool = True) -> Optional[Peer]:
        """``peer``; over TCP its process looked for only when ``pid`` asks (status, curves and
        forget need the user alone, and the scan is the costly part of a lookup)."""
        if self._first is None:
            return None
        if self._ipc_path is not None:
            return _sender(self._first)
        return self.loopback.of(descriptor(self._first), pid) if self.endpoint.startswith("tcp://") else None

    def bind(self) -> None:
        """Bind, or raise ConfigError with one line saying why (busy, stale, no permission)."""
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES * 4)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        if self.zap is not None:
            if self.zap.sock is None:
                self.zap.bind()  # first: a handshake before it would go unchecked
            assert self.curve_secret_key is not None  # the gate is made only with a key
            sock.curve_secretkey = self.curve_secret_key
            sock.curve_publickey = zmq.curve_public(self.curve_secret_key)
            sock.curve_server = True
            sock.zap_domain = DOMAIN
        guard = Guard(sock, self.max_connections)  # its monitor first: it must see every connection
        try:
            if self.endpoint.startswith("ipc://"):
                self._prepare_ipc(self.endpoint[len("ipc://"):])
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            guard.close()
            sock.close(0)
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError("endpoint %s is in use by another process (--endpoint)" % self.endpoint) from None
            raise ConfigError("cannot bind endpoint %s: %s (--endpoint)" % (self.endpoint, exc.strerror)) from None
        if self._ipc_path is not None:
            try:
                os.chmod(self._ipc_path, self.socket_mode)
            except OSError:
                pass
        self.sock, self.guard = sock, guard
        self._poller = zmq.Poller()  # one for the daemon's life: Socket.poll() builds one per call
        self._poller.register(sock, zmq.POLLIN)
        if self.zap is not None:
            self._poller.register(self.zap.sock, zmq.POLLIN)
            self._zap_sock = self.zap.sock

    def _prepare_ipc(self, path: str) -> None:
        """Make the socket's directory; refuse to steal a live daemon's socket, clear a stale one."""
        directory = os.path.dirname(path) or "."
        try:
            os.makedirs(directory, mode=0o750, exist_ok=True)
        except OSError as exc:
            raise ConfigError("cannot create socket directory %s: %s (--endpoint)"
                              % (directory, exc.strerror)) from None
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            self._ipc_path = path
            return
        if not stat.S_ISSOCK(mode):
            raise ConfigError("%s exists and is not a socket (--endpoint)" % path)
        if _answers(self.context, "ipc://" + path):
            raise ConfigError("endpoint ipc://%s is in use: another memd answers there (--endpoint)" % path)
        os.unlink(path)  # left behind by a daemon that did not stop cleanly
        self._ipc_path = path

    def poll(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for requests and handle what arrived; returns how many."""
        assert self.sock is not None and self.guard is not None
        if self._dropped_bytes >= TRIM_AFTER:
            self._trim()
        guard = self.guard
        now = time.monotonic()
        deadline = now + timeout
        while True:  # the guard looks every few ms while bytes come, whether or not requests do
            if now >= guard.due:
                guard.check(now, self._caught_up, self.received)
                self._caught_up = False
                if guard.idle is not self._waking:
                    self._wake_on(guard)
            ready = self._poller.poll(max(0, math.ceil((min(deadline, guard.due) - now) * 1000)))
            if ready and (not self._waking or any(s is self.sock or s is self._zap_sock for s, _ in ready)):
                break
            if ready:
                guard.due = now  # bytes or a connection came to an idle guard: it looks at once
            self._caught_up = True  # nothing waits
            now = time.monotonic()
            if now >= deadline:
                return 0
        if self.zap is not None:
            self.zap.serve()  # handshakes waiting for the allow-list's word
        handled = 0
        # The poller said a message waits: take it, then ask EVENTS whether more do (an
        # exception per poll, zmq.Again, would cost more than a request).
        while handled < BATCH:
            try:
                frames, dropped = self._receive()
            except zmq.Again:
                self._caught_up = True
                break
            handled += 1
            if self.revoked and self.zap is not None:  # its key was taken off the allow-list since
                self.zap.revoked_messages += 1  # it connected: as if it had never been admitted
            else:
                self._handle(frames, dropped)
            if not self.sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]  # pyzmq: int | bytes; EVENTS is an int
                self._caught_up = True
                break
        self.received += handled
        return handled

    def _wake_on(self, guard: Guard) -> None:
        """Wait on the guard's wakers while it is idle, not while it looks every few ms."""
        for waker in guard.wakers:
            if guard.idle:
                self._poller.register(waker, zmq.POLLIN)
            else:
                self._poller.unregister(waker)
        self._waking = guard.idle

    def _trim(self) -> None:
        """Give the C heap's free pages back, at most once a second: libzmq holds a whole message
        before memd sees its first frame, and glibc kept what it freed after (64 MiB after one
        400-frame message of 80 MB)."""
        now = time.monotonic()
        if now >= self._trim_at:
            self._trim_at, self._dropped_bytes = now + 1.0, 0
            trim_heap()

    def _receive(self):
        """One message: (its first MAX_FRAMES frames, how many more were dropped); its sender in
        ``self.peer``. libzmq has the whole message by now (it delivers none before the last
        frame), but frames beyond the protocol's are neither copied nor kept: a 400-frame message
        was copied whole and echoed back (80 MB each way). Raises zmq.Again when nothing waits."""
        first = self._first = self.sock.recv(_NOBLOCK, copy=False)
        self.key = _property(first, "User-Id") if self.zap is not None else None
        self.revoked = self.zap is not None and not self.zap.admits(self.key)
        frames = [first.bytes]
        dropped = 0
        while self.sock.getsockopt(_RCVMORE):
            if len(frames) < MAX_FRAMES:
                frames.append(self.sock.recv(_NOBLOCK))
            else:
                self._dropped_bytes += len(self.sock.recv(_NOBLOCK, copy=False))  # freed at once
                dropped += 1
        if not dropped:
            self.guard.came_by(first)
        return frames, dropped

    def _handle(self, frames: List[bytes], dropped: int = 0) -> None:
        assert self.sock is not None  # bound: called from poll()
        start = time.perf_counter()
        if len(frames) < 2:
            return  # cannot happen on a ROUTER; nothing to route a reply to
        envelope, payload = frames[:-1], frames[-1]
        reply, op, outcome = self._reply_to(envelope, payload, dropped)
        if dropped or not _valid_envelope(envelope):
            envelope = envelope[:1]  # answered, never echoed back to its sender
        try:
            data = protocol.encode(reply)
        except Exception as exc:  # a result msgpack cannot carry (an int past 64 bits) once ended the daemon
            reply, _, outcome = self._failed(op, exc, reply.get("id"))
            data = protocol.encode(reply)
        try:
            for frame in envelope:  # send_multipart, without its per-call Python overhead
                self.sock.send(frame, _NOBLOCK | _SNDMORE)
            self.sock.send(data, _NOBLOCK)
        except zmq.ZMQError:
            outcome = "unsent"  # the peer is gone or not reading; ROUTER would drop it anyway
        self.observe(op, outcome, time.perf_counter() - start)

    def _reply_to(self, envelope: List[bytes], payload: bytes, dropped: int = 0):
        request_id = None
        op = "invalid"
        try:
            if dropped or not _valid_envelope(envelope):
                raise _Error(protocol.BAD_REQUEST, "expected one message frame (DEALER) or an empty delimiter (REQ), "
                                                   "got %d frames" % (len(envelope) + dropped))
            if len(payload) > protocol.MAX_MESSAGE_BYTES:
                raise _Error(protocol.TOO_LARGE, "message of %d bytes exceeds the %d-byte limit"
                             % (len(payload), protocol.MAX_MESSAGE_BYTES))
            try:
                request = protocol.decode(payload)
            except ValueError as exc:
                raise _Error(protocol.BAD_REQUEST, str(exc)) from None
            if not isinstance(request, dict):
                raise _Error(protocol.BAD_REQUEST, "a request must be a map, not %s" % type(request).__name__)
            request_id = request.get("id")
            if not whole(request_id):
                request_id = None
                raise _Error(protocol.BAD_REQUEST, "id must be an integer")
            if type(request.get("v")) is not int or request["v"] != protocol.VERSION:  # true == 1 in Python
                raise _Error(protocol.UNSUPPORTED_VERSION, "protocol version %r is not supported (this daemon "
                             "speaks %d)" % (request.get("v"), protocol.VERSION))
            name = request.get("op")
            if not isinstance(name, str):
                raise Invalid("op is required" if name is None else "op must be a string, not %s" % type(name).__name__)
            if name not in self.dispatch:
                raise _Error(protocol.UNKNOWN_OP, "unknown op %r" % name[:64])
            op = name
            result = self.dispatch[op](request)
            return {"v": protocol.VERSION, "id": request_id, "ok": True, "result": result}, op, "ok"
        except _Error as exc:
            code, message = exc.code, exc.message
        except UnknownSession as exc:
            code, message = protocol.UNKNOWN_SESSION, exc.args[0]
        except TooManySessions as exc:
            code, message = protocol.TOO_MANY_SESSIONS, str(exc)
        except Invalid as exc:
            code, message = protocol.INVALID, str(exc)
        except Exception as exc:  # a bug in a handler (any other ValueError too) must not take the daemon down
            return self._failed(op, exc, request_id)
        return _error(request_id, code, message), op, code

    def _failed(self, op: str, exc: Exception, request_id: Any):
        """A daemon bug as an ``internal`` reply; its traceback logged (call it in the except
        block) at most once a minute per op and error: one message can repeat a bug as fast as
        a peer sends it."""
        held = self.throttle.allow((op, type(exc).__name__))
        if held is not None:
            log.exception("handler_failed", op=op, error=type(exc).__name__, held_back=held)
        return _error(request_id, protocol.INTERNAL, "internal error: %s" % type(exc).__name__), op, protocol.INTERNAL

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        if self.zap is not None:
            self.zap.close()
        self.context.term()
        if self._ipc_path is not None:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass
            self._ipc_path = None


def _sender(frame: zmq.Frame) -> Optional[Peer]:
    return peer_of(_property(frame, "Peer-Address"))


def _property(frame: zmq.Frame, name: str) -> Optional[str]:
    """A property libzmq set on a received message (its sender's address, its CURVE key)."""
    try:
        value = frame.get(name)
    except (zmq.ZMQError, UnicodeDecodeError):  # not set (a libzmq built without peer credentials)
        return None
    return value if isinstance(value, str) else None


def _valid_envelope(envelope: List[bytes]) -> bool:
    """The peer's identity, and a REQ socket's empty delimiter if it is one."""
    return len(envelope) == 1 or (len(envelope) == 2 and envelope[1] == b"")


def _error(request_id: Any, code: str, message: str) -> Dict[str, Any]:
    return {"v": protocol.VERSION, "id": request_id, "ok": False, "error": {"code": code, "message": message}}


class _Error(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _answers(context: zmq.Context, endpoint: str, timeout: float = 0.3) -> bool:
    """Whether a daemon answers ``ping`` at ``endpoint`` (used before clearing a socket file)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(protocol.encode(protocol.request("ping", 1)))
        return bool(sock.poll(timeout * 1000, zmq.POLLIN))
    finally:
        sock.close(0)

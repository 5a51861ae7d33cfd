"""The server's CURVE allow-list: a ZAP handler (ZeroMQ RFC 27) answered in its own poll loop.

A CURVE socket encrypts, but who may talk is decided by whoever answers ZAP requests at
``inproc://zeromq.zap.01`` on the socket's context; with nobody there libzmq admits every client
key (issue 12: a random key got a session token). So the handler is bound before the control
socket, and a key that is not listed is refused during the handshake: its client gets no reply
at all, never a session.

Not pyzmq's ThreadAuthenticator: it adds a thread running an asyncio loop to answer a message a
connection, while the server's poll loop can answer it in microseconds; a reload (SIGHUP) then
swaps the allow-list in the thread that reads it, with no lock; and its loader logs an unreadable
key directory and carries on admitting nobody, where memd must refuse to start and say why.
"""
from __future__ import annotations

import os
from typing import FrozenSet, List, Optional, Tuple

import structlog
import zmq
from zmq.utils import z85

from memd.client import curve
from memd.config import ConfigError
from memd.logs import Throttle

log = structlog.get_logger("memd.zap")

ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: libzmq asks there
DOMAIN = b"memd"
BATCH = 64  # requests answered per poll: one per connection handshake


def load_allow_list(directory: str) -> FrozenSet[bytes]:
    """The public keys (32 bytes each) of every ``*.key`` file in ``directory``, as
    ``zmq.auth.create_certificates`` and ``memd keygen`` write them (other files are ignored).
    Raises ConfigError naming the directory or the file."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".key"))
    except OSError as exc:
        raise ConfigError("curve_client_keys_dir %s unreadable: %s" % (directory, exc.strerror or exc)) from None
    keys = set()
    for name in names:
        try:
            keys.add(z85.decode(curve.read_public_key(os.path.join(directory, name), "client key file")))
        except ValueError as exc:
            raise ConfigError("curve_client_keys_dir: %s" % exc) from None
    return frozenset(keys)


def answer(frames: List[bytes], allowed: FrozenSet[bytes]) -> Tuple[List[bytes], Optional[str]]:
    """The reply to one ZAP request (version, request id, domain, address, identity, mechanism,
    credentials) and, when refused, why (for the log). An admitted client's Z85 key is its
    User-Id, a property of each message it sends."""
    request_id = frames[1] if len(frames) > 1 else b""
    if len(frames) < 6 or frames[0] != b"1.0":
        return _reply(request_id, b"400", b"malformed ZAP request"), "malformed ZAP request"
    mechanism, credentials = frames[5], frames[6:]
    if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
        return _reply(request_id, b"400", b"CURVE only"), "mechanism %s" % mechanism[:16].decode("ascii", "replace")
    key = credentials[0]
    if key not in allowed:
        return _reply(request_id, b"400", b"key not allowed"), "key not in curve_client_keys_dir"
    return _reply(request_id, b"200", b"OK", z85.encode(key)), None


def _reply(request_id: bytes, status: bytes, text: bytes, user_id: bytes = b"") -> List[bytes]:
    return [b"1.0", request_id, status, text, user_id, b""]


class Gate:
    """The ZAP socket on the server's context, answered from the server's poll loop."""

    def __init__(self, context: zmq.Context, allowed: FrozenSet[bytes], throttle: Optional[Throttle] = None):
        self.context = context
        self.revoked_messages = 0  # dropped from connections whose key was taken off the list
        self.admit(allowed)
        self.throttle = throttle or Throttle(interval=60.0)  # a refused peer reconnects; its log line does not repeat
        self.refused = 0  # handshakes refused, ever
        self.sock: Optional[zmq.Socket] = None

    def bind(self) -> zmq.Socket:
        """Bind the handler; before the control socket, so no handshake goes unchecked."""
        sock = self.context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ENDPOINT)
        self.sock = sock
        return sock

    def admit(self, allowed: FrozenSet[bytes]) -> None:
        """Replace the allow-list (reload): new handshakes are checked against it, and a key taken
        off it is refused on connections it already has (admits)."""
        self.allowed = allowed
        self._listed = frozenset(z85.encode(key).decode() for key in allowed)

    def admits(self, user_id: Optional[str]) -> bool:
        """Whether a message's sender (its User-Id, the key this gate admitted it with) is listed
        now: a handshake is checked once, so a key removed at a reload would otherwise keep every
        connection it already had."""
        return user_id in self._listed

    def serve(self) -> int:
        """Answer the requests waiting, without blocking; returns how many."""
        handled = 0
        # EVENTS, not a recv raising Again: the server calls this on every wake-up.
        # pyzmq types every option's value int | bytes; EVENTS is an int.
        while self.sock is not None and handled < BATCH and \
                self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type, operator]
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
            reply, refusal = answer(frames, self.allowed)
            self.sock.send_multipart(reply)  # a REP socket must answer before it reads again
            handled += 1
            if refusal is not None:
                self._refused(frames, refusal)
        return handled

    def _refused(self, frames: List[bytes], why: str) -> None:
        self.refused += 1
        held = self.throttle.allow("refused")
        if held is not None:
            key = z85.encode(frames[6]).decode() if len(frames) > 6 and len(frames[6]) == 32 else None
            address = frames[3].decode("ascii", "replace")[:64] if len(frames) > 3 else None
            log.warning("curve_handshake_refused", reason=why, client_key=key, address=address, held_back=held,
                        refused_total=self.refused)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

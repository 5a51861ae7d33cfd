"""``call``: one request and its reply, for tools (``memd status``, ``memd curves``); it raises,
where a Session never does."""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional

import zmq

from . import curve, protocol


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

"""A raw ZMTP 3.0 peer over a plain socket (NULL mechanism, as a DEALER): what a hostile peer
can send that no libzmq socket will, such as frames of a message it never ends (libzmq sends
a message only once it is whole)."""
from __future__ import annotations

import socket
import struct


def _exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data


def connect(endpoint: str, timeout: float = 5.0) -> socket.socket:
    """Connected and past the handshake: the daemon's greeting and READY read (libzmq refuses
    a large frame that comes in one read with the handshake)."""
    if endpoint.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(timeout)
        sock.connect(endpoint[len("ipc://"):])
    else:
        host, port = endpoint[len("tcp://"):].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    sock.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
    _exact(sock, 64)
    flags = _exact(sock, 1)[0]
    size = struct.unpack(">Q", _exact(sock, 8))[0] if flags & 2 else _exact(sock, 1)[0]
    _exact(sock, size)
    return sock


def frame(data: bytes, more: bool) -> bytes:
    """One message frame; ``more``: another frame of the same message follows."""
    if len(data) < 256:
        return bytes([int(more), len(data)]) + data
    return bytes([2 | int(more)]) + struct.pack(">Q", len(data)) + data

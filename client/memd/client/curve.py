"""CURVE keys (CurveZMQ, ZeroMQ's encryption and authentication) for both ends of a ``tcp://``
endpoint beyond loopback: where they come from, what files hold them, how a socket takes them.

Key files are the ones pyzmq's ``zmq.auth.create_certificates`` (and ``memd keygen``) write:
``NAME.key`` holds the public key (``public-key = "..."``; given away: to the daemon's
allow-list, to the clients), ``NAME.key_secret`` both keys (kept private). A file holding only a
40-character Z85 secret key is also read. The daemon's end uses this module too (the daemon
depends on this distribution), so both read one format.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

import zmq
from zmq.utils import z85

SERVER_KEY_ENV = "MEMD_SERVER_KEY"  # the daemon's public key: 40 Z85 characters, or its .key file
CLIENT_KEY_FILE_ENV = "MEMD_CLIENT_KEY_FILE"  # this client's .key_secret file
MAX_FILE_BYTES = 64 * 1024  # a key file is a few hundred bytes
HINT = "with CURVE, no reply also means the daemon refused this client's key (not in its allow-list) " \
       "or the server key is not the daemon's"


@dataclass(frozen=True)
class ClientKeys:
    """What a client socket needs to talk CURVE to the daemon (all keys Z85)."""
    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.SyncSocket) -> None:
        """Before ``connect``: the handshake then proves the daemon holds ``server_public``'s
        secret, and the daemon's allow-list decides on ``public``."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def client_keys(server_key: Optional[str] = None, client_key_file: Optional[str] = None,
                environ: Optional[Mapping[str, str]] = None) -> Optional[ClientKeys]:
    """The keys given, each argument falling back on its environment variable; None when neither
    names a server key (no CURVE: ipc:// and loopback). Raises ValueError, one line naming the
    key and its origin, when one half is missing or a key is unusable."""
    env = os.environ if environ is None else environ
    server_origin = "server_key" if server_key else SERVER_KEY_ENV
    file_origin = "client_key_file" if client_key_file else CLIENT_KEY_FILE_ENV
    server_key = server_key or env.get(SERVER_KEY_ENV) or None
    client_key_file = client_key_file or env.get(CLIENT_KEY_FILE_ENV) or None
    if server_key is None and client_key_file is None:
        return None
    if server_key is None:
        raise ValueError("%s is set but no server key (server_key, %s, --server-key): CURVE needs the daemon's "
                         "public key" % (file_origin, SERVER_KEY_ENV))
    if client_key_file is None:
        raise ValueError("%s is set but no client key file (client_key_file, %s, --client-key): the daemon "
                         "admits only the keys in its allow-list" % (server_origin, CLIENT_KEY_FILE_ENV))
    public, secret = read_keypair(client_key_file, file_origin)
    return ClientKeys(server_public_key(server_key, server_origin), public, secret)


def server_public_key(value: str, origin: str = "server_key") -> bytes:
    """The daemon's public key from 40 Z85 characters, or from the path of its ``.key`` file."""
    text = value.strip()
    if len(text) == 40 and _z85(text.encode("ascii", "replace")) is not None:
        return text.encode("ascii")
    return read_public_key(text, origin)


def read_keypair(path: str, origin: str) -> Tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file, or from a file holding only the secret key;
    a public key that is not the secret's is refused (the handshake would fail without a word)."""
    keys = _read(path, origin)
    secret = keys.get("secret-key", keys.get("bare"))
    if secret is None:
        raise ValueError("%s %s holds no secret-key (a .key_secret file, not the public .key)" % (origin, path))
    public = zmq.curve_public(secret)
    if keys.get("public-key", public) != public:
        raise ValueError("%s %s: its public-key is not the one of its secret-key" % (origin, path))
    return public, secret


def read_public_key(path: str, origin: str) -> bytes:
    """The public key of a ``.key`` file (or of a file holding only that key), as Z85. Never
    derived from a bare key: a public key mistaken for a secret one would admit whoever uses the
    (public) key as their secret."""
    keys = _read(path, origin)
    public = keys.get("public-key", keys.get("bare"))
    if public is None:
        raise ValueError("%s %s holds no public-key" % (origin, path))
    return public


def write_keypair(directory: str, name: str) -> Tuple[str, str]:
    """Write ``NAME.key`` (0644) and ``NAME.key_secret`` (0600, never readable by others even for
    an instant) in ``directory`` with pyzmq's writer; refuses to overwrite. Returns both paths."""
    from zmq.auth import create_certificates  # imports asyncio: kept off a training job's path

    paths = [os.path.join(directory, name + suffix) for suffix in (".key", ".key_secret")]
    for path in paths:
        if os.path.lexists(path):
            raise FileExistsError("%s exists: keys are never overwritten (remove it first)" % path)
    os.makedirs(directory, exist_ok=True)
    old = os.umask(0o077)
    try:
        public_file, secret_file = create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(public_file, 0o644)
    return public_file, secret_file


def _read(path: str, origin: str) -> Dict[str, bytes]:
    """The keys a key file holds: "public-key", "secret-key" (zmq.auth's format), or "bare" (a
    file of one 40-character Z85 key). Raises ValueError naming the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES)
    except OSError as exc:
        raise ValueError("%s %s unreadable: %s" % (origin, path, exc.strerror or exc)) from None
    if _z85(data.strip()) is not None:
        return {"bare": data.strip()}
    found: Dict[str, bytes] = {}
    for line in data.splitlines():
        raw_name, sep, value = line.strip().partition(b"=")
        name = raw_name.strip().decode("ascii", "replace")
        if sep and name in ("public-key", "secret-key"):
            key = value.strip(b" \t'\"")
            if _z85(key) is None:
                raise ValueError("%s %s: its %s is not a 40-character Z85 key" % (origin, path, name))
            found[name] = key
    return found


def _z85(key: bytes) -> Optional[bytes]:
    """The 32 bytes a 40-character Z85 key stands for, or None."""
    if len(key) != 40:
        return None
    try:
        return z85.decode(key)
    except (KeyError, ValueError, struct.error):  # a character outside Z85, or a group beyond 2**32
        return None

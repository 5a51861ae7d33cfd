"""Where the daemon listens when nobody says (the control endpoint both ends pick with no
configuration), and whether whoever answers on an ``ipc://`` socket can be memd.

Plain ``os`` and ``stat``: the daemon's configuration imports this without loading the codec.
"""
from __future__ import annotations

import os
import stat
from typing import Mapping, Optional

SYSTEM_SOCKET = "/run/memd/memd.sock"


def default_endpoint(environ: Optional[Mapping[str, str]] = None, system_socket: Optional[str] = None,
                     euid: Optional[int] = None) -> str:
    """The control endpoint that client and daemon both pick with no configuration.

    MEMD_ENDPOINT wins; then the system service's socket (``system_socket``, SYSTEM_SOCKET
    unless a test names another) if it exists, or for root (``euid`` 0) in any case: the daemon
    run as root binds it, so a root job started before its daemon, and `memd status` or `memd
    doctor` as root, look where it will be (they looked in /tmp/memd-0); then a per-user socket.
    """
    env = os.environ if environ is None else environ
    if env.get("MEMD_ENDPOINT"):
        return env["MEMD_ENDPOINT"]
    system = SYSTEM_SOCKET if system_socket is None else system_socket
    if os.path.exists(system) or (os.geteuid() if euid is None else euid) == 0:
        return "ipc://" + system
    return "ipc://" + user_socket_path(env)


def user_socket_path(environ: Optional[Mapping[str, str]] = None) -> str:
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "memd.sock")
    return "/tmp/memd-%d/memd.sock" % os.getuid()


def stranger(endpoint: str) -> Optional[str]:
    """Why the socket of an ``ipc://`` endpoint cannot be the daemon's, or None.

    Whoever answers on the socket steers the job's memory. Where anyone may create files (the
    per-user /tmp/memd-$UID when XDG_RUNTIME_DIR is unset), another user can make the directory
    or the socket first and answer as memd: they are trusted only when this user or root owns
    them. A directory made elsewhere (/run/memd by systemd) took privilege to make.
    """
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None  # TCP (CURVE's business) or an abstract socket
    path = os.path.abspath(endpoint[len("ipc://"):])
    directory = os.path.dirname(path)
    trusted = (os.getuid(), 0)
    try:
        here = os.stat(directory)
        if here.st_mode & stat.S_IWOTH:  # anyone may make the socket itself
            owner = os.lstat(path).st_uid
            return None if owner in trusted else "socket %s belongs to uid %d, not to this user or root" % (path, owner)
        if here.st_uid not in trusted and os.stat(os.path.dirname(directory)).st_mode & stat.S_IWOTH:
            return "socket directory %s belongs to uid %d, not to this user or root" % (directory, here.st_uid)
    except OSError:
        return None  # nothing there: connecting finds no daemon, and says so
    return None

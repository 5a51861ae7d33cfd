"""What each peer may see of other jobs (`status`, `curves`) and forget (`forget`).

A job's name, pid, host and plan say what someone runs; a learned curve says what it costs.
Local users see each other's processes in `ps`, so a local peer (the ipc socket, whose kernel
credentials the daemon reads, or loopback TCP) sees local jobs; a job that came in over CURVE
(a remote client's key) is that key's business alone, and a keyed peer sees only its own key's.
Root and the user the daemon runs as (who can read its state file and logs anyway) see all.
Pure functions: who asks is decided at the edge (memd.server, memd.daemon).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from memd.sessions import KEY_OWNER, Peer, SessionRecord

_KEY = KEY_OWNER[1:]  # "key:": how a curve's owner (state.owner_of) names a CURVE key


class Viewer(NamedTuple):
    """Who asks, as far as the daemon knows it."""
    admin: bool  # root, or the daemon's own user: sees everything
    key: Optional[str]  # the CURVE key (Z85) the peer was admitted with; None: a local peer


EVERYONE = Viewer(admin=True, key=None)  # in-process callers (tests, benchmarks)


def viewer(peer: Optional[Peer], key: Optional[str], daemon_uid: int) -> Viewer:
    """The viewer for a message: ``peer`` is the kernel's word on its sender (None where it is
    not known), ``key`` its CURVE key. An admin's key does not narrow what the kernel says they
    may see."""
    return Viewer(admin=peer is not None and peer.uid in (0, daemon_uid), key=key)


def sees_session(who: Viewer, session: SessionRecord) -> bool:
    """A keyed peer sees its key's sessions; a local peer the sessions not opened with a key."""
    return who.admin or session.key == who.key


def sees_curve(who: Viewer, owner: Optional[str]) -> bool:
    """The same for a curve, by its owner (state.owner_of: "uid:N", "key:KEY" or None)."""
    if who.admin:
        return True
    if who.key is not None:
        return owner == _KEY + who.key
    return owner is None or not owner.startswith(_KEY)

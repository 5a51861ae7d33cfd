"""What each peer may see (memd.visibility): pure rules, checked without a daemon (the real
daemon's are in test_e2e_visibility.py)."""
from types import SimpleNamespace

from memd.sessions import Peer
from memd.visibility import EVERYONE, sees_curve, sees_session, viewer

KEY, OTHER = "A" * 40, "B" * 40
DAEMON_UID = 990  # the user the daemon runs as (the service's `memd`)


def test_root_and_the_daemons_own_user_are_admins_whatever_their_key():
    assert viewer(Peer(0, 1), None, DAEMON_UID).admin
    assert viewer(Peer(0, 1), KEY, DAEMON_UID).admin  # root with a key (the CLI over CURVE)
    assert viewer(Peer(DAEMON_UID, None), None, DAEMON_UID).admin
    assert not viewer(Peer(1000, 1), None, DAEMON_UID).admin
    assert not viewer(None, None, DAEMON_UID).admin  # the kernel did not say: not root
    assert not viewer(None, KEY, 0).admin


def test_a_keyed_peer_sees_its_keys_sessions_and_curves_only():
    who = viewer(None, KEY, DAEMON_UID)
    assert sees_session(who, SimpleNamespace(key=KEY))
    assert not sees_session(who, SimpleNamespace(key=OTHER))
    assert not sees_session(who, SimpleNamespace(key=None))  # a local job
    assert sees_curve(who, "key:" + KEY)
    assert not any(sees_curve(who, owner) for owner in ("key:" + OTHER, "uid:0", "uid:1000", None))


def test_a_local_peer_sees_local_sessions_and_curves_not_keyed_ones():
    who = viewer(Peer(1000, 4242), None, DAEMON_UID)
    assert sees_session(who, SimpleNamespace(key=None))
    assert not sees_session(who, SimpleNamespace(key=KEY))
    assert all(sees_curve(who, owner) for owner in ("uid:0", "uid:1000", "uid:65534", None))
    assert not sees_curve(who, "key:" + KEY)
    assert sees_curve(viewer(None, None, DAEMON_UID), "uid:0")  # a loopback peer the kernel did not name


def test_an_admin_sees_everything():
    for who in (EVERYONE, viewer(Peer(0, 1), KEY, DAEMON_UID)):
        assert all(sees_session(who, SimpleNamespace(key=k)) for k in (None, KEY, OTHER))
        assert all(sees_curve(who, o) for o in (None, "uid:0", "key:" + KEY, "key:" + OTHER))

"""The kernel says who asks: over the ipc socket memd reads the sender's uid (SO_PEERCRED,
libzmq's Peer-Address), so what a hello claims about a process is checked against who sent it.

Real daemon, real ipc socket, a real second user (`nobody`, forked from the root test process).
"""
import os
import shutil
import socket
import tempfile

import pytest

from memd import client
from memd.sampling import procs
from memd.server import Peer, peer_of
from nobody import Flood, as_nobody
from realdaemon import wait_for

GiB = 1 << 30


def test_the_peer_address_of_an_ipc_connection_names_its_user():
    assert peer_of("localhost:1000:1000:4242") == Peer(1000, 4242)
    assert peer_of("localhost:501:20:") == Peer(501, None)  # macOS: no pid
    assert peer_of("127.0.0.1") is None and peer_of("") is None and peer_of(None) is None  # TCP: nobody known
    assert peer_of("[::1]:x:y:z") is None


@pytest.fixture
def shared(start_memd):
    """A daemon whose ipc socket another user may connect to."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to ask as another user")
    directory = tempfile.mkdtemp(prefix="memd-peer-")
    os.chmod(directory, 0o755)
    memd = start_memd(endpoint="ipc://%s/memd.sock" % directory)
    os.chmod(os.path.join(directory, "memd.sock"), 0o666)
    yield memd
    shutil.rmtree(directory, ignore_errors=True)


def _hello(endpoint, pid, job, **fields):
    """A hello written by hand, naming ``pid`` with the very fields its own client would send."""
    return client.call("hello", endpoint=endpoint, job=job, pid=pid, host=socket.gethostname(),
                       pid_ns=procs.pid_namespace("self"), start_time=procs.process_start_time(pid),
                       default_batch=4, **fields)


def test_a_hello_naming_another_users_process_is_neither_watched_nor_remembered(shared):
    victim = os.getpid()  # root's process; anyone can read its start time and pid namespace

    def forge():
        reply = _hello(shared.endpoint, victim, "llama-ft")
        for _ in range(3):
            client.call("report", endpoint=shared.endpoint, token=reply["token"], batch_size=4, peak_bytes=3 * GiB)
        client.call("bye", endpoint=shared.endpoint, token=reply["token"])
        return reply["plan"]["reason"]

    reason = as_nobody(forge)
    assert "another user's process" in reason, reason
    assert not [c for c in shared.call("curves")["curves"] if c["job"] == "llama-ft"]  # nothing learned

    # The same hello from root, the process's owner, is watched.
    token = _hello(shared.endpoint, victim, "llama-ft")["token"]
    (mine,) = [s for s in shared.call("status")["sessions"] if s["job"] == "llama-ft"]
    assert mine["unwatched"] is None
    shared.call("bye", token=token)


def flooding(endpoint):
    """Flood's hello: a job of nobody's, named for its place in the flood, its pid its own."""
    return lambda i: _hello(endpoint, os.getpid(), "flood-%d" % i)


def test_one_users_flood_of_sessions_gives_way_to_another_users_job(start_memd):
    """Every slot taken by one user's live process: another process of that user gets its share
    (the flood's newest give way), another user's job still gets one, and the flood cannot take
    them back."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to ask as another user")
    directory = tempfile.mkdtemp(prefix="memd-peer-")
    floods = []
    try:
        os.chmod(directory, 0o755)
        path = os.path.join(directory, "memd.sock")
        config = os.path.join(directory, "memd.toml")
        with open(config, "w") as f:
            f.write("max_sessions = 8\n")
        memd = start_memd(endpoint="ipc://" + path, args=["--config", config])
        os.chmod(path, 0o666)

        floods.append(Flood(flooding(memd.endpoint), 10))
        assert floods[0].codes == ["ok"] * 8 + ["too_many_sessions"] * 2  # one user alone may fill every slot
        floods.append(Flood(flooding(memd.endpoint), 5))  # the same user's second process gets its share: 4 of 8
        assert floods[1].codes == ["ok"] * 4 + ["too_many_sessions"], floods[1].codes
        floods[1].close()
        floods.pop()
        assert wait_for(lambda: len(memd.call("status")["sessions"]) == 4)  # its sessions end with it
        floods.append(Flood(flooding(memd.endpoint), 5))  # another process of the same user: the free slots
        assert floods[1].codes == ["ok"] * 4 + ["too_many_sessions"], floods[1].codes
        floods[1].close()
        floods.pop()
        floods[0].close()
        floods.pop()
        floods.append(Flood(flooding(memd.endpoint), 10))
        token = _hello(memd.endpoint, os.getpid(), "mine")["token"]  # root's job gets one
        jobs = sorted(s["job"] for s in memd.call("status")["sessions"])
        assert jobs == ["flood-%d" % i for i in range(7)] + ["mine"], jobs  # the newest of the flood gave way
        # another process of that user: a slot of its flood, not root's
        floods.append(Flood(flooding(memd.endpoint), 1))
        assert floods[1].codes == ["ok"]
        held = [(s["job"], s["pid"]) for s in memd.call("status")["sessions"]]
        assert ("mine", os.getpid()) in held and sum(pid == floods[0].pid for _, pid in held) == 6, held
        memd.call("bye", token=token)
    finally:
        for flood in reversed(floods):  # a later child holds the earlier ones' pipes
            flood.close()
        shutil.rmtree(directory, ignore_errors=True)

"""Sessions and their ends, through the ops a client calls: a retried hello, bye, expiry and the
room a hello makes all end a session the same way (ops.end). No daemon, no sockets."""
import pytest

from memd import ops
from memd.config import Config
from memd.core import Core
from memd.sampling.snapshot import CPU, Snapshot, SystemMemory
from memd.sessions import Sessions, TooManySessions
from memd.state import StateStore

GB = 10 ** 9
NONCE = "n" * 32


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def core_for(tmp_path, max_sessions=8, ttl=60.0):
    """A Core as the daemon builds it, over a host of 64 GB with no GPU; its sessions are of
    another host (the daemon cannot watch them), so only silence ends them."""
    clock = Clock()
    core = Core(config=Config(), sessions=Sessions(max_sessions, ttl, clock, lambda s: True),
                store=StateStore(str(tmp_path)), clock=clock, host="here")
    core.snapshot = Snapshot(taken_at=0.0, monotonic=0.0, host="here", memory_model=CPU,
                             system=SystemMemory(64 * GB, 48 * GB, 16 * GB, 0, 0), pressure=None, cgroup=None)
    return core, clock


def hello(job="a", pid=1, **extra):
    return dict(job=job, pid=pid, host="remote", min_batch=1, default_batch=8, **extra)


def learn(core, token):
    for batch in (8, 8, 16):  # the warm-up step, then two that are remembered
        ops.report(core, {"token": token, "batch_size": batch, "peak_bytes": GB + batch * GB // 10})


def test_a_retried_hello_with_the_same_nonce_gets_the_first_session(tmp_path):
    core, _ = core_for(tmp_path)
    first = ops.hello(core, hello(nonce=NONCE))
    again = ops.hello(core, hello(nonce=NONCE))
    assert again["token"] == first["token"] and again["plan"] == first["plan"]
    assert len(core.sessions) == 1
    other = ops.hello(core, hello(nonce="m" * 32))  # another Session of the same process
    assert other["token"] != first["token"] and len(core.sessions) == 2
    assert ops.hello(core, hello())["token"] not in (first["token"], other["token"])  # no nonce: always new


def test_a_nonce_ends_with_its_session(tmp_path):
    core, _ = core_for(tmp_path)
    token = ops.hello(core, hello(nonce=NONCE))["token"]
    ops.bye(core, {"token": token})
    again = ops.hello(core, hello(nonce=NONCE))["token"]
    assert again != token and len(core.sessions) == 1


def test_a_nonce_is_the_processs_own(tmp_path):
    core, _ = core_for(tmp_path)
    token = ops.hello(core, hello(nonce=NONCE))["token"]
    assert ops.hello(core, hello(pid=2, nonce=NONCE))["token"] != token  # another process: its own session
    assert ops.hello(core, dict(hello(nonce=NONCE), host="elsewhere"))["token"] != token
    assert len(core.sessions) == 3


@pytest.mark.parametrize("nonce, why", [
    ("short", "16 to 64"), ("x" * 65, "at most 64"), (12345678901234567890, "string"),
])
def test_a_bad_nonce_is_refused_and_changes_nothing(tmp_path, nonce, why):
    core, _ = core_for(tmp_path)
    with pytest.raises(ops.Invalid, match=why):
        ops.hello(core, hello(nonce=nonce))
    assert len(core.sessions) == 0 and core.epoch == 0


def test_a_nonce_of_another_jobs_session_is_refused_and_changes_nothing(tmp_path):
    core, _ = core_for(tmp_path)
    token = ops.hello(core, hello(nonce=NONCE))["token"]
    with pytest.raises(ops.Invalid, match="another job"):
        ops.hello(core, hello(job="b", nonce=NONCE))
    assert [s.token for s in core.sessions] == [token] and core.sessions.get(token).job == "a"


def test_bye_remembers_without_counting_an_expiry(tmp_path):
    core, _ = core_for(tmp_path)
    token = ops.hello(core, hello())["token"]
    learn(core, token)
    ops.bye(core, {"token": token})
    assert len(core.store) == 1 and core.sessions_expired == 0


def test_expiry_remembers_and_counts(tmp_path):
    core, clock = core_for(tmp_path, ttl=60.0)
    token = ops.hello(core, hello())["token"]
    learn(core, token)
    clock.now += 61
    ops.expire(core)
    assert len(core.sessions) == 0 and len(core.store) == 1 and core.sessions_expired == 1


def test_sessions_expired_to_make_room_at_hello_are_remembered_and_counted(tmp_path):
    """A full registry expires what is over before it refuses a hello; those sessions were once
    dropped there without their curve being kept or their end counted."""
    core, clock = core_for(tmp_path, max_sessions=2, ttl=60.0)
    silent = ops.hello(core, hello(job="silent"))["token"]
    learn(core, silent)
    clock.now += 50
    ops.hello(core, hello(job="alive", pid=2))
    clock.now += 20  # "silent" is past its ttl, "alive" is not
    ops.hello(core, hello(job="new", pid=3))
    assert sorted(s.job for s in core.sessions) == ["alive", "new"]
    assert core.sessions_expired == 1 and len(core.store) == 1
    with pytest.raises(TooManySessions):  # nothing left to expire: refused, nothing changed
        ops.hello(core, hello(job="more", pid=4))
    assert sorted(s.job for s in core.sessions) == ["alive", "new"]

"""Sessions and their ends, through the ops a client calls: a retried hello, bye, expiry and the
room a hello makes all end a session the same way (ops.end). No daemon, no sockets."""
import dataclasses

import pytest

from memd import ops
from memd.config import Config
from memd.core import Core
from memd.ops import memo
from memd.sampling.snapshot import CPU, JobMemory, ProcessMemory, Snapshot, SystemMemory
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
    processes on this host (pids 1-9 of a fixture /proc), which it takes to live on (only
    silence ends them here), so what they learn is kept."""
    clock = Clock()
    for pid in range(1, 10):
        (tmp_path / "proc" / str(pid)).mkdir(parents=True)
    core = Core(config=Config(), sessions=Sessions(max_sessions, ttl, clock, lambda s: True),
                store=StateStore(str(tmp_path / "state")), clock=clock, host="here",
                proc_root=str(tmp_path / "proc"))
    core.snapshot = Snapshot(taken_at=0.0, monotonic=0.0, host="here", memory_model=CPU,
                             system=SystemMemory(64 * GB, 48 * GB, 16 * GB, 0, 0), pressure=None, cgroup=None)
    return core, clock


def hello(job="a", pid=1, **extra):
    return dict(job=job, pid=pid, host="here", min_batch=1, default_batch=8, **extra)


def resample(core, clock):
    """A sample of the machine taken after the reports so far (the plan pairs free memory with
    what the job held when it was taken), and a read of each watched job's process (1 GB)."""
    clock.now += 1
    core.snapshot = dataclasses.replace(core.snapshot, monotonic=clock.now)
    core.jobs = {s.pid: JobMemory(s.pid, (ProcessMemory(s.pid, 1, "python", GB, GB, GB),), None, (), clock.now)
                 for s in core.sessions if s.local}


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


def test_sessions_memd_cannot_watch_take_a_quarter_of_the_slots_and_are_never_remembered(tmp_path):
    """What a peer on another host (or with a pid memd cannot check) claims is its own plan's
    business: it holds at most a quarter of the slots (256 of them held every slot for the
    ttl after their creator left), teaches no curve (one report under a job's name from
    elsewhere replaced that job's curve), and reserves nothing from the sessions memd watches
    (one claiming 20 GB of fixed memory cut a real job's plan from 1034 to 58)."""
    core, clock = core_for(tmp_path, max_sessions=12)
    local = ops.hello(core, hello(job="real"))["token"]
    learn(core, local)
    resample(core, clock)
    alone = ops.plan(core, {"token": local})["plan"]
    claims = {"fixed_bytes": 20 * GB, "per_sample_bytes": GB}  # a prior of 20 GB + 1 GB a sample
    remote = [ops.hello(core, dict(hello(job="real", pid=100), host="elsewhere"))["token"],
              ops.hello(core, dict(hello(job="claims", pid=101), host="elsewhere", hints=claims))["token"],
              ops.hello(core, dict(hello(job="claims", pid=102), host="elsewhere", hints=claims))["token"]]
    with pytest.raises(TooManySessions, match="cannot watch"):
        ops.hello(core, dict(hello(job="third", pid=200), host="elsewhere"))
    resample(core, clock)
    after = ops.plan(core, {"token": local})["plan"]
    assert after["batch_size"] == alone["batch_size"] > 16, (alone, after)  # the remote claims took nothing
    for batch in (8, 8, 16):  # it reports under the local job's name, too, and ends last
        ops.report(core, {"token": remote[0], "batch_size": batch, "peak_bytes": 5 * GB})
    key = core.sessions.get(local).pool_key
    ops.bye(core, {"token": local})
    for token in remote:
        ops.bye(core, {"token": token})
    memory = core.store.recall("real", key)
    assert [(o.batch, o.peak_bytes) for o in memory.observations] == [(8, GB + 8 * GB // 10), (16, GB + 16 * GB // 10)]
    ops.hello(core, hello(job="local-again", pid=4))  # the host's own jobs still get every other slot


def test_a_step_that_went_as_planned_is_decided_on_at_the_next_sample(tmp_path, monkeypatch):
    """A report at the planned batch whose peak is within the predicted one, on the sample the
    plan was decided on, is kept and learned from at the next decision; one over the prediction,
    or at another batch, is decided on at once (memd.ops.session_ops.as_planned: half the decisions of a job
    that reports 10 times a second)."""
    core, clock = core_for(tmp_path)
    token = ops.hello(core, hello())["token"]
    learn(core, token)
    resample(core, clock)
    plan = ops.plan(core, {"token": token})["plan"]
    session = core.sessions.get(token)
    decided = []
    real = memo.plan_session
    monkeypatch.setattr(memo, "plan_session", lambda *a: decided.append(1) or real(*a))
    batch, within = plan["batch_size"], int(session.predicted_peak_bytes)
    assert ops.report(core, {"token": token, "batch_size": batch, "peak_bytes": within})["plan"] == plan
    assert decided == [] and session.observations[-1].peak_bytes == within  # kept, not decided on
    ops.report(core, {"token": token, "batch_size": batch, "peak_bytes": within + 1})  # over the prediction
    assert decided == [1]
    ops.report(core, {"token": token, "batch_size": batch - 1, "peak_bytes": GB})  # another batch
    assert decided == [1, 1]
    resample(core, clock)
    ops.report(core, {"token": token, "batch_size": ops.plan(core, {"token": token})["plan"]["batch_size"],
                      "peak_bytes": GB})
    assert len(decided) == 3  # a new sample: the plan call decided, on everything reported


def test_the_step_a_plan_holds_for_is_decided_on_at_once(tmp_path, monkeypatch):
    """A plan that waits for a second step at its new batch, or for the clean steps after an
    out-of-memory cut, changes with the step that ends the wait: that step is decided on at once,
    even on the plan's own sample and within its prediction. Deferred to the next sample (as_planned),
    the reply and every plan until then said "keeping 32 until a second step there" after it."""
    core, clock = core_for(tmp_path)
    token = ops.hello(core, hello())["token"]
    learn(core, token)
    resample(core, clock)
    batch = ops.plan(core, {"token": token})["plan"]["batch_size"]
    assert batch > 16
    decided = []
    real = memo.plan_session
    monkeypatch.setattr(memo, "plan_session", lambda *a: decided.append(1) or real(*a))

    def step(batch):
        return ops.report(core, {"token": token, "batch_size": batch, "peak_bytes": GB + batch * GB // 10})["plan"]

    assert step(batch)["batch_size"] == batch and decided == []  # its first step there: the plan still waits
    grown = step(batch)  # the second: the wait is over
    assert decided == [1] and grown["batch_size"] > batch, grown
    assert ops.plan(core, {"token": token})["plan"] == grown  # and a plan call says the same
    stable = core.config.policy.stable_steps
    cut = ops.oom(core, {"token": token, "batch_size": grown["batch_size"]})["plan"]["batch_size"]
    decided.clear()
    for _ in range(stable - 1):
        step(cut)
    assert len(decided) < stable - 1  # steps at the cut that go as planned wait for the next sample
    held = len(decided)
    assert step(cut)["batch_size"] > cut and len(decided) == held + 1  # the last of the stable steps: grows back


def test_a_rejoining_job_keeps_its_running_batch_under_a_remembered_ceiling_and_bad_input_changes_nothing(tmp_path):
    core, _ = core_for(tmp_path)
    token = ops.hello(core, hello())["token"]
    learn(core, token)
    ops.oom(core, {"token": token, "batch_size": 32})
    ops.bye(core, {"token": token})  # remembered: its curve and the ceiling 31
    with pytest.raises(ops.Invalid, match="batch_size"):
        ops.hello(core, hello(batch_size=0))
    assert len(core.sessions) == 0  # refused before anything changed
    session = core.sessions.get(ops.hello(core, hello(batch_size=24))["token"])
    assert session.state.batch == 24 and session.state.ceiling == 31 and session.rejoined

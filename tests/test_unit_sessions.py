"""The session registry (memd/sessions.py) on its own: a clock and a liveness check injected, no
daemon. What a record keeps (history, held peaks, what may be remembered) and what the registry
does at its bounds (full, unwatched share, expiry, tokens, nonces)."""
import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memd.policy.controller import Limits
from memd.policy.fit import Observation
from memd.sessions import CLEAN_RUNS, HISTORY, SessionRecord, Sessions, TooManySessions, UnknownSession


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def registry(max_sessions=8, ttl=60.0, alive=lambda s: True):
    clock = Clock()
    return Sessions(max_sessions, ttl, clock, alive), clock


def open_one(sessions, pid=1, local=True, nonce=None, host="h"):
    return sessions.open(job="j", pid=pid, host=host, local=local, start_time=None, limits=Limits(), nonce=nonce)


def test_each_session_gets_its_own_unguessable_token_and_a_small_number():
    sessions, clock = registry()
    a, b = open_one(sessions), open_one(sessions, pid=2)
    assert (a.sid, b.sid) == (1, 2) and a.token != b.token and len(a.token) >= 24
    assert (a.created, a.last_seen) == (100.0, 100.0)
    clock.now = 130.0
    assert sessions.get(a.token) is a and a.last_seen == 130.0  # a request keeps it alive
    for token in ("nope", None, 7, [a.token]):
        with pytest.raises(UnknownSession):
            sessions.get(token)


def test_close_forgets_the_token_and_the_nonce():
    sessions, _ = registry()
    a = open_one(sessions, nonce="n1")
    assert sessions.find("h", 1, "n1") is a and sessions.find("other", 1, "n1") is None
    assert sessions.close(a.token) is a and sessions.close(a.token) is None
    assert sessions.find("h", 1, "n1") is None and len(sessions) == 0
    with pytest.raises(UnknownSession):
        sessions.get(a.token)


def test_expiry_takes_the_silent_and_the_dead_and_nothing_else():
    dead = set()
    sessions, clock = registry(ttl=60.0, alive=lambda s: s.pid not in dead)
    quiet, busy, gone = open_one(sessions, 1), open_one(sessions, 2), open_one(sessions, 3)
    clock.now = 160.0
    sessions.get(busy.token)
    assert sessions.expire() == []  # 60 s of silence is not more than the ttl
    dead.add(3)
    clock.now = 160.5
    assert sorted(s.sid for s in sessions.expire()) == [quiet.sid, gone.sid]
    assert list(sessions) == [busy]


def test_a_full_registry_refuses_and_unwatched_sessions_get_a_quarter():
    sessions, _ = registry(max_sessions=8)
    unwatched = [open_one(sessions, pid=10 + i, local=False) for i in range(2)]
    with pytest.raises(TooManySessions, match="cannot watch"):
        open_one(sessions, pid=20, local=False)
    watched = [open_one(sessions, pid=30 + i) for i in range(6)]
    assert sessions.full() and len(unwatched + watched) == 8
    with pytest.raises(TooManySessions, match="8 sessions are open"):
        open_one(sessions, pid=40)


def test_remote_keys_share_the_unwatched_quarter_and_never_end_a_local_session():
    """Over CURVE a key is a user: a second key's remote hello takes the newest of the key
    holding the most unwatched sessions, never a watched session (remote sessions take no local room)."""
    sessions, _ = registry(max_sessions=8)
    flood = [sessions.open(job="j", pid=10 + i, host="far", local=False, start_time=None, limits=Limits(), key="A")
             for i in range(2)]
    assert sessions.crowding(None, "B", local=False) is flood[-1]  # the quarter is full: A's newest gives way
    assert sessions.crowding(None, "A", local=False) is None  # A's own flood takes nothing of its own
    sessions.close(flood[-1].token)
    sessions.open(job="j", pid=20, host="far", local=False, start_time=None, limits=Limits(), key="B")
    assert sessions.crowding(None, "B", local=False) is None  # one each: neither gives way
    for i in range(6):
        open_one(sessions, pid=30 + i)
    assert sessions.full()
    assert sessions.crowding(None, "C", local=False) is None  # one each, and no watched session is a remote's room
    assert sessions.crowding(None, "C", local=True) is not None and sessions.crowding(None, "C").key is None


def test_iterating_is_over_a_copy():
    sessions, _ = registry()
    for pid in range(3):
        open_one(sessions, pid)
    for s in sessions:
        sessions.close(s.token)  # ending sessions while walking them (ops.end does)
    assert len(sessions) == 0


def record(**fields):
    return SessionRecord(token="t", sid=1, job="j", pid=7, host="h", local=True, start_time=None, limits=Limits(),
                         created=0.0, last_seen=0.0, **fields)


def test_a_full_history_drops_the_oldest_report_of_its_most_repeated_batch():
    s = record()
    for step in range(HISTORY):
        s.observe(Observation(1 if step else 32, 1000 + step))
    s.observe(Observation(2, 5000))
    batches = [o.batch for o in s.observations]
    assert len(batches) == HISTORY and 32 in batches and batches[-1] == 2
    assert s.observations[1].peak_bytes == 1002  # the first report at 1 went
    assert s.observed == HISTORY + 1 and s.observed_at[0] == 0 and s.observed_at[1] == 2


def test_what_a_job_held_is_read_as_of_a_time_and_unknown_after_an_oom():
    s = record()
    assert s.peak_held_at(5.0) == 0 and not s.holding_unknown()
    s.note_peak(1.0, 300)
    s.note_peak(2.0, 200)  # a caching allocator keeps what it reserved: the largest since the OOM
    assert (s.peak_held_at(0.5), s.peak_held_at(1.5), s.peak_held_at(9.0)) == (0, 300, 300)
    s.note_oom(3.0)
    assert s.holding_unknown() and s.peak_held_at(3.5) == 0 and s.peak_held_at(2.5) == 300
    s.note_peak(4.0, 100)
    assert not s.holding_unknown() and s.peak_held_at(4.0) == 100


def test_learned_keeps_past_warmup_and_lifts_a_ceiling_after_clean_runs():
    s = record(remembered=[Observation(4, 400)], inherited_ceiling=16)
    s.observe(Observation(8, 800, warmup=True))
    s.observe(Observation(8, 810))
    kept, ceiling, clean = s.learned(stable_steps=10)
    assert [o.peak_bytes for o in kept] == [400, 810] and (ceiling, clean) == (16, 0)
    s.ceiling_steps = 10  # held at the ceiling long enough: this run went clean there
    assert s.learned(10)[1:] == (16, 1)
    s.clean_runs = CLEAN_RUNS - 1
    assert s.learned(10)[1:] == (None, 0)  # the third clean run lifts it
    s.forget_learned()
    s.observe(Observation(16, 1600))
    assert [o.peak_bytes for o in s.learned(10)[0]] == [1600]  # only what came after the forget


@given(st.lists(st.integers(1, 6), max_size=3 * HISTORY))
def test_kept_reports_are_those_of_the_rule_with_their_counts_kept_alongside(batches):
    """observe() keeps its per-batch counts as it goes: the reports it keeps are the rule's (when
    full, the oldest of the batch size with the most goes), recounted from scratch each time."""
    s = SessionRecord(token="t", sid=1, job="j", pid=1, host="h", local=True, start_time=None, limits=Limits(),
                      created=0.0, last_seen=0.0)
    expected = []
    for step, batch in enumerate(batches):
        if len(expected) >= HISTORY:
            counts = collections.Counter(o.batch for o in expected)
            most = max(counts.values())
            del expected[next(i for i, o in enumerate(expected) if counts[o.batch] == most)]
        observation = Observation(batch, 1000 + step)
        expected.append(observation)
        s.observe(observation)
    assert s.observations == expected
    assert s.batch_counts == collections.Counter(o.batch for o in expected)

"""What memd remembers, shown and forgotten: the Store's listing and forgetting, a `curves`
reply's pages, a session's learning after a forget, and `memd curves`' human output."""
import json

from memd.policy.fit import Observation
from memd.state import MAX_POINTS, StateStore


def store_with(tmp_path, *entries):
    store = StateStore(str(tmp_path))
    store.load()
    for job, pool, points, ceiling in entries:
        store.remember(job, pool, [Observation(b, p) for b, p in points], ceiling)
    return store


# -- StateStore.keys / forget ----------------------------------------------------------------


def test_keys_are_sorted_by_job_then_pool_not_by_use(tmp_path):
    store = store_with(tmp_path, ("b", "host:59", [(4, 10)], None), ("a", "host:7", [(2, 5)], None),
                       ("a", "gpu:H100:85", [(8, 9)], 7))
    store.recall("b", "host:59")
    store.remember("a", "host:7", [Observation(3, 6)], None)  # the most recent use: last in LRU order
    assert store.keys() == [("a", "gpu:H100:85"), ("a", "host:7"), ("b", "host:59")]
    memory = store.recall(*store.keys()[0])
    assert memory.observations == (Observation(8, 9),) and memory.ceiling == 7 and memory.updated > 0


def test_a_job_name_with_a_bar_is_split_at_the_pool_key(tmp_path):
    store = store_with(tmp_path, ("team|exp", "host:59", [(4, 10)], None))
    assert store.keys() == [("team|exp", "host:59")] and store.recall("team|exp", "host:59") is not None
    assert store.forget("team") == [] and store.forget("team|exp") == ["host:59"]


def test_forget_drops_every_pool_or_one_and_survives_a_reload(tmp_path):
    store = store_with(tmp_path, ("job", "host:59", [(4, 10)], None), ("job", "gpu:H100:85", [(8, 9)], 31),
                       ("job2", "host:59", [(2, 5)], None))
    assert store.flush() and not store.dirty
    assert store.forget("job", "gpu:H100:85") == ["gpu:H100:85"]
    assert store.dirty and store.recall("job", "host:59") is not None
    assert store.forget("job") == ["host:59"]
    assert store.flush()
    again = StateStore(str(tmp_path))
    again.load()
    assert again.keys() == [("job2", "host:59")]


def test_forgetting_nothing_changes_nothing(tmp_path):
    store = store_with(tmp_path, ("job", "host:59", [(4, 10)], None))
    assert store.flush()
    assert store.forget("other") == [] and store.forget("job", "host:7") == [] and store.forget("jo") == []
    assert not store.dirty and len(store) == 1


def test_load_drops_entries_a_reply_could_not_carry(tmp_path):
    good = {"points": [[4, 10]], "ceiling": None, "updated": 1.0}
    jobs = {
        "ok|host:59": good,
        "x" * 600 + "|host:59": good,  # a key no daemon makes
        "many|host:59": dict(good, points=[[1, 1]] * (MAX_POINTS + 1)),
        "huge|host:59": dict(good, points=[[4, 10 ** 30]]),  # beyond msgpack
        "ceil|host:59": dict(good, ceiling=True),
        "when|host:59": dict(good, updated="yesterday"),
        "nobar": good,
    }
    (tmp_path / "curves.json").write_text(json.dumps({"version": 1, "jobs": jobs}))
    store = StateStore(str(tmp_path))
    store.load()
    assert store.keys() == [("ok", "host:59")]


# -- a `curves` reply's pages -------------------------------------------------------------------


def full_store(tmp_path, jobs=512):
    """The Store at its bounds: every job named with 128 four-byte characters, on a long pool
    key, with MAX_POINTS points of the largest numbers a file may hold."""
    from memd.state import MAX_INT, MAX_KEY_CHARS

    store = StateStore(str(tmp_path), max_jobs=jobs)
    pool = "\U0001F600" * (MAX_KEY_CHARS - 129)
    for i in range(jobs):
        job = ("%03d" % i) + "\U0001F600" * 125
        store.remember(job, pool, [Observation(MAX_INT, MAX_INT)] * MAX_POINTS, MAX_INT)
    return store


def test_one_entry_at_its_bounds_fits_entry_bytes(tmp_path):
    from memd.client import protocol
    from memd.curves import ENTRY_BYTES, view

    store = full_store(tmp_path, jobs=1)
    [(job, pool)] = store.keys()
    assert len(job) + 1 + len(pool) == 512
    assert len(protocol.encode(view(job, pool, store.recall(job, pool)))) <= ENTRY_BYTES


def test_pages_of_a_full_store_each_fit_a_message_and_show_everything_once(tmp_path):
    from memd.client import protocol
    from memd.curves import page

    store = full_store(tmp_path)
    keys = store.keys()
    assert len(protocol.encode(keys)) > protocol.MAX_MESSAGE_BYTES  # not even their names fit one reply
    seen, after, pages = [], None, 0
    while True:
        result = page(keys, store.recall, after)
        reply = {"v": protocol.VERSION, "id": 2 ** 63 - 1, "ok": True, "result": result}
        assert len(protocol.encode(reply)) <= protocol.MAX_MESSAGE_BYTES
        assert result["total"] == 512 and result["curves"]
        seen += [(c["job"], c["pool"]) for c in result["curves"]]
        pages += 1
        after = result["next"]
        if after is None:
            break
    assert seen == keys and pages > 1


def test_a_page_starts_after_its_cursor_even_when_that_entry_is_gone(tmp_path):
    from memd.curves import page

    store = store_with(tmp_path, *[("job%d" % i, "host:59", [(4, 10)], None) for i in range(5)])
    first = page(store.keys(), store.recall, budget=1)  # one entry a page
    assert [c["job"] for c in first["curves"]] == ["job0"] and first["next"] == ["job0", "host:59"]
    store.forget("job0")
    store.forget("job1")
    second = page(store.keys(), store.recall, first["next"], budget=1)
    assert [c["job"] for c in second["curves"]] == ["job2"]
    last = page(store.keys(), store.recall, ["job4", "host:59"])
    assert last == {"curves": [], "total": 3, "next": None}
    everything = page(store.keys(), store.recall)
    assert [c["job"] for c in everything["curves"]] == ["job2", "job3", "job4"] and everything["next"] is None
    assert everything["curves"][0] == {"job": "job2", "pool": "host:59", "points": [[4, 10]], "owner": None,
                                       "ceiling": None, "ceiling_cause": None, "clean_runs": 0,
                                       "updated": everything["curves"][0]["updated"]}
    assert isinstance(everything["curves"][0]["updated"], int)


# -- what a live session may still remember after a forget ----------------------------------------


def make_session(**fields):
    from memd.policy.controller import ControlState, Limits
    from memd.sessions import SessionRecord

    return SessionRecord(token="t", sid=1, job="j", pid=1, host="h", local=False, start_time=None, limits=Limits(),
                   created=0.0, last_seen=0.0, state=ControlState(ceiling=31), **fields)


def test_a_session_remembers_only_what_it_learned_after_a_forget():
    session = make_session(inherited_ceiling=31, remembered=[Observation(2, 20)])
    for i, batch in enumerate((4, 4, 8)):
        session.observe(Observation(batch, batch * 10, warmup=i == 0))
    # What its earlier runs left and what it learned (the warm-up never), the ceiling it started with
    assert session.learned(10) == ([Observation(2, 20), Observation(4, 40), Observation(8, 80)], 31, 0)
    session.forget_learned()
    assert session.learned(10) == ([], None, 0)  # neither its points nor the ceiling it started with
    session.observe(Observation(16, 160))
    assert session.learned(10) == ([Observation(16, 160)], None, 0)
    session.ooms += 1  # an OOM after the forget: its ceiling is new learning
    assert session.learned(10) == ([Observation(16, 160)], 31, 0)


def test_a_remembered_ceiling_is_lifted_after_three_runs_held_at_it_go_clean():
    from memd.sessions import CLEAN_RUNS

    assert CLEAN_RUNS == 3
    held = make_session(inherited_ceiling=31, clean_runs=1, ceiling_steps=10)
    assert held.learned(10) == ([], 31, 2)  # held at the ceiling for 10 clean steps: one more clean run
    assert make_session(inherited_ceiling=31, clean_runs=1, ceiling_steps=9).learned(10) == ([], 31, 1)  # too few
    assert make_session(inherited_ceiling=31, clean_runs=2, ceiling_steps=10).learned(10) == ([], None, 0)  # lifted
    oomed = make_session(inherited_ceiling=31, clean_runs=2, ceiling_steps=10, ooms=1)
    assert oomed.learned(10) == ([], 31, 0)  # ran out of memory again: the count starts over


def test_remember_keeps_every_batch_size_when_a_run_repeats_one():
    """32 points at most: the oldest of the most repeated batch size go first, so a long run at
    one batch does not push the batch sizes an earlier run taught out of the curve."""
    store = StateStore("/nonexistent")
    earlier = [Observation(b, b * 10) for b in (4, 8, 16)]
    store.remember("j", "cpu:7", earlier + [Observation(32, 320 + i) for i in range(40)], 31, 2)
    memory = store.recall("j", "cpu:7")
    assert len(memory.observations) == MAX_POINTS and memory.observations[:3] == tuple(earlier)
    assert memory.observations[-1] == Observation(32, 359) and memory.ceiling == 31 and memory.clean_runs == 2
    store.remember("j", "cpu:7", [], None)  # a lifted ceiling with no points: nothing left to keep
    assert store.recall("j", "cpu:7") is None


def test_forget_of_a_pool_names_every_configuration_in_it(tmp_path):
    store = store_with(tmp_path, ("j", "cpu:7", [(4, 10)], None), ("j", "cpu:7#0a1b2c3d", [(4, 10)], None),
                       ("j", "cpu:15", [(4, 10)], None))
    assert store.forget("j", "cpu:7") == ["cpu:7", "cpu:7#0a1b2c3d"]
    assert store.keys() == [("j", "cpu:15")]


def test_a_forget_long_ago_keeps_the_whole_history():
    from memd.sessions import HISTORY

    session = make_session()
    session.observe(Observation(4, 40))
    session.forget_learned()
    for _ in range(HISTORY + 5):
        session.observe(Observation(8, 80))
    observations, _, _ = session.learned(10)
    # The history keeps its one report at 4 (batch sizes before repeats: SessionRecord.observe), which
    # came before the forget; every other report it holds came after.
    assert len(session.observations) == HISTORY and session.observations[0] == Observation(4, 40)
    assert observations == [Observation(8, 80)] * (HISTORY - 1)


# -- memd curves, for people and for scripts ------------------------------------------------------


def test_render_shows_gib_by_batch_within_80_columns():
    from memd.cli_curves import render

    GiB = 2 ** 30
    points = [[b, b * GiB // 4] for b in range(1, 21)] + [[8, 2 * GiB + GiB // 50]] * 3
    text = render([{"job": "llama-ft", "pool": "gpu:NVIDIA H100 80GB HBM3:85520809984", "points": points,
                    "ceiling": 31, "updated": 1795523039, "owner": "uid:0"},
                   {"job": "only-oom", "pool": "cpu:23", "points": [], "ceiling": 7, "updated": 0, "clean_runs": 2}])
    lines = text.splitlines()
    assert lines[0] == "memd remembers 2 curves (`memd forget JOB` drops a job's)"
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "  pool      gpu:NVIDIA H100 80GB HBM3:85520809984" in lines
    assert "  owner     root (uid:0)" in lines and "  owner     unknown (kept before curves had owners)" in lines
    assert "  ceiling   31 (out of memory above it; lifted after 3 more clean runs)" in lines
    assert "  ceiling   7 (out of memory above it; lifted after 1 more clean run)" in lines
    body = " ".join(text.split())
    assert "peak GiB at batch 1: 0.25, 2: 0.50," in body
    assert "8: 2.00-2.02 (4 steps)," in body and "20: 5.00" in body  # one batch's points as their range
    assert sum(line.startswith("  peak GiB") for line in lines) == 2 and "  peak GiB  no points" in lines
    assert render([]) == "memd remembers no curves yet\n"


def test_fetch_asks_page_after_page_and_refuses_a_reply_that_does_not_advance():
    import pytest

    from memd.cli_curves import fetch
    from memd.client import DaemonUnavailable

    pages = {None: {"curves": [{"job": "a"}], "next": ["a", "p"]},
             ("a", "p"): {"curves": [{"job": "b"}], "next": ["b", "p"]},
             ("b", "p"): {"curves": [{"job": "c"}], "next": None}}
    asked = []

    def ask(after):
        asked.append(after)
        return pages[tuple(after) if after else None]

    assert [c["job"] for c in fetch(ask)] == ["a", "b", "c"] and asked == [None, ["a", "p"], ["b", "p"]]
    for stuck in ({"curves": [], "next": ["a", "p"]}, {"curves": [{"job": "a"}], "next": [1, 2]},
                  {"curves": None, "next": None}):
        with pytest.raises(DaemonUnavailable):
            fetch(lambda after: stuck)
    replies = iter([{"curves": [{"job": "b"}], "next": ["b", "p"]}, {"curves": [{"job": "a"}], "next": ["a", "p"]}])
    with pytest.raises(DaemonUnavailable, match="did not advance"):
        fetch(lambda after: next(replies))


def test_a_background_write_never_brings_back_what_a_forget_dropped(tmp_path):
    """flush_soon writes on a thread of its own; a forget's flush() written before it must not
    be overwritten by it, whatever the order they reach the disk in."""
    store = store_with(tmp_path, ("keep", "cpu:7", [(4, 10)], None))
    store.flush_soon()  # generation 1: "keep"
    store.remember("gone", "cpu:7", [Observation(4, 10)], None)
    store.flush_soon()  # generation 2: "keep" and "gone"
    store.forget("gone")
    assert store.flush()  # generation 3, written before it returns
    store.close()  # every background write done
    assert set(json.loads((tmp_path / "curves.json").read_text())["jobs"]) == {"keep|cpu:7"}
    assert not store.dirty

    assert store._write('{"version": 1, "jobs": {}}', 2) is True  # generation 2 arriving last: skipped
    assert set(json.loads((tmp_path / "curves.json").read_text())["jobs"]) == {"keep|cpu:7"}


def test_a_background_write_the_disk_refuses_is_tried_again(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the state directory should be: every write fails
    store = StateStore(str(blocked / "state"))
    store.remember("j", "cpu:7", [Observation(4, 10)], None)
    store.flush_soon()
    store.close()
    assert store.dirty  # kept for the next flush
    assert store.flush() is False and store.dirty


def test_a_user_who_fills_the_store_evicts_their_own_curves_first(tmp_path):
    """512 junk job names from one peer once evicted every curve: the least recently used
    curve of whoever holds the most goes first."""
    store = StateStore(str(tmp_path), max_jobs=4)
    store.remember("theirs", "cpu:7@uid:1000", [Observation(4, 10)], None)
    store.remember("legacy", "cpu:7", [Observation(4, 10)], None)  # kept by an earlier memd: no owner
    for i in range(5):
        store.remember("junk%d" % i, "cpu:7@uid:65534", [Observation(4, 10)], None)
    assert store.keys() == [("junk3", "cpu:7@uid:65534"), ("junk4", "cpu:7@uid:65534"),
                            ("legacy", "cpu:7"), ("theirs", "cpu:7@uid:1000")]
    from memd.curves import view

    assert view("theirs", "cpu:7@uid:1000", store.recall("theirs", "cpu:7@uid:1000"))["owner"] == "uid:1000"
    assert view("legacy", "cpu:7", store.recall("legacy", "cpu:7"))["owner"] is None
    assert store.forget("junk3", "cpu:7") == ["cpu:7@uid:65534"]  # a pool names every owner in it


def test_a_stalled_disk_holds_one_waiting_state_not_one_per_flush(tmp_path, monkeypatch):
    import threading

    store = StateStore(str(tmp_path))
    gate, written = threading.Event(), []
    real = store._write

    def slow(text, generation):
        gate.wait(10)
        written.append(generation)
        return real(text, generation)

    monkeypatch.setattr(store, "_write", slow)
    for i in range(50):  # a flush every 2 s while the disk hangs
        store.remember("j%d" % i, "cpu:7", [Observation(4, 10)], None)
        store.flush_soon()
    assert store._pending is not None and store._pending[1] == 50  # one state waits: the newest
    gate.set()
    store.close()
    assert written[-1] == 50 and len(written) <= 2  # the first, then the newest; none in between
    assert len(json.loads((tmp_path / "curves.json").read_text())["jobs"]) == 50


# -- curves owned by a CURVE key ------------------------------------------------------------------

# Real Z85 public keys hold "@", "#" and ":" (memd keygen wrote the first); the second holds "@uid:".
KEY_A = "RV<q1X/YQ}Z}/u#x3#:?UGDp%ulD(*yVA.viC8OE"
KEY_B = "abcdefghij@uid:0123456789ABCDEFGHIJKLMNO"


def test_a_keys_owner_is_found_by_its_length_whatever_its_characters():
    from memd.state import base_pool, owner_of, split_owner

    assert split_owner("cpu:7#0a1b2c3d@key:" + KEY_A) == ("cpu:7#0a1b2c3d", "key:" + KEY_A)
    assert split_owner("cpu:7@key:" + KEY_B) == ("cpu:7", "key:" + KEY_B)
    assert base_pool("cpu:7@key:" + KEY_A) == "cpu:7" and base_pool("cpu:7#0a1b2c3d@uid:0") == "cpu:7"
    assert owner_of("cpu:7@uid:1000") == "uid:1000" and owner_of("cpu:7") is None
    assert owner_of("cpu:7@key:short") is None  # not a key: 40 characters or none


def test_a_keys_flood_evicts_its_own_curves_never_a_local_jobs_nor_another_keys(tmp_path):
    """A key keeps at most max_per_key curves, and keys' curves are bounded apart from local
    ones: 512 junk names from one key once could have evicted every curve."""
    store = StateStore(str(tmp_path), max_jobs=4, max_per_key=3)
    store.remember("local", "cpu:7@uid:1000", [Observation(4, 10)], None)
    store.remember("legacy", "cpu:7", [Observation(4, 10)], None)
    store.remember("theirs", "cpu:7@key:" + KEY_B, [Observation(4, 10)], None)
    for i in range(10):
        store.remember("junk%d" % i, "cpu:7@key:" + KEY_A, [Observation(4, 10)], None)
    assert store.keys() == [("junk7", "cpu:7@key:" + KEY_A), ("junk8", "cpu:7@key:" + KEY_A),
                            ("junk9", "cpu:7@key:" + KEY_A), ("legacy", "cpu:7"), ("local", "cpu:7@uid:1000"),
                            ("theirs", "cpu:7@key:" + KEY_B)]
    for i in range(10):  # local jobs filling their store evict neither keys' curves, nor keys theirs
        store.remember("mine%d" % i, "cpu:7@uid:1000", [Observation(4, 10)], None)
    assert len([k for k in store.keys() if "@key:" in k[1]]) == 4 and len(store) == 8


def test_keys_curves_are_bounded_together_the_key_with_most_giving_way(tmp_path):
    store = StateStore(str(tmp_path), max_jobs=4, max_per_key=3)
    for i in range(3):
        store.remember("a%d" % i, "cpu:7@key:" + KEY_A, [Observation(4, 10)], None)
    store.remember("b0", "cpu:7@key:" + KEY_B, [Observation(4, 10)], None)
    store.remember("b1", "cpu:7@key:" + KEY_B, [Observation(4, 10)], None)  # five: KEY_A, with three, gives one
    assert [job for job, _ in store.keys()] == ["a1", "a2", "b0", "b1"]


def test_a_key_forgets_its_own_and_counts_survive_a_reload(tmp_path):
    store = StateStore(str(tmp_path), max_per_key=2)
    for owner in ("@key:" + KEY_A, "@key:" + KEY_B, "@uid:0"):
        store.remember("job", "cpu:7" + owner, [Observation(4, 10)], None)
    key_a = "key:" + KEY_A
    assert store.forget("job", mine=lambda owner: owner == key_a) == ["cpu:7@key:" + KEY_A]
    assert store.forget("job", "cpu:7", mine=lambda owner: owner == key_a) == []
    assert store.flush()
    again = StateStore(str(tmp_path), max_per_key=2)
    again.load()
    for i in range(3):
        again.remember("new%d" % i, "cpu:7@key:" + KEY_B, [Observation(4, 10)], None)
    assert sorted(again.keys()) == [("job", "cpu:7@uid:0"), ("new1", "cpu:7@key:" + KEY_B),
                                    ("new2", "cpu:7@key:" + KEY_B)]  # its curve from before the restart counted

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


# -- StateStore.entries / forget ----------------------------------------------------------------


def test_entries_are_sorted_by_job_then_pool_not_by_use(tmp_path):
    store = store_with(tmp_path, ("b", "host:59", [(4, 10)], None), ("a", "host:7", [(2, 5)], None),
                       ("a", "gpu:H100:85", [(8, 9)], 7))
    store.recall("b", "host:59")
    store.remember("a", "host:7", [Observation(3, 6)], None)  # the most recent use: last in LRU order
    listed = [(job, pool) for job, pool, _ in store.entries()]
    assert listed == [("a", "gpu:H100:85"), ("a", "host:7"), ("b", "host:59")]
    memory = store.entries()[0][2]
    assert memory.observations == (Observation(8, 9),) and memory.ceiling == 7 and memory.updated > 0


def test_a_job_name_with_a_bar_is_split_at_the_pool_key(tmp_path):
    store = store_with(tmp_path, ("team|exp", "host:59", [(4, 10)], None))
    assert [(job, pool) for job, pool, _ in store.entries()] == [("team|exp", "host:59")]
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
    assert [(job, pool) for job, pool, _ in again.entries()] == [("job2", "host:59")]


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
    assert [job for job, _, _ in store.entries()] == ["ok"]

"""Bounded work per request, bounded logs, and what a killed daemon leaves behind: a hint
beyond any model, a peer repeating a bad request, a flush cut short by kill -9."""
import os
import time

GB = 10 ** 9


def _core_with_host(tmp_path, available):
    """A Core as the daemon builds it, over a synthetic snapshot of a host with no GPU."""
    from memd.config import Config
    from memd.core import Core
    from memd.sampling.snapshot import CPU, Snapshot, SystemMemory
    from memd.sessions import Sessions
    from memd.state import StateStore

    core = Core(config=Config(), sessions=Sessions(16, 60.0, time.monotonic, lambda s: True),
                store=StateStore(str(tmp_path)), host="elsewhere")
    core.snapshot = Snapshot(taken_at=0.0, monotonic=0.0, host="elsewhere", memory_model=CPU,
                             system=SystemMemory(64 * GB, available, 0, 0, 0), pressure=None, cgroup=None)
    return core


def within(seconds, fn, *args):
    """fn(*args), or a failed test after ``seconds`` (the call goes on in a thread, unwaited)."""
    import threading

    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "still running after %.1f s" % seconds
    return out["value"]


def test_a_hint_beyond_any_model_is_ignored_at_once_and_logged_once(tmp_path):
    """layers 10**7 cost 15 s and 1.2 GB of the daemon before hints had ranges (measured)."""
    from structlog.testing import capture_logs

    from memd import ops

    core = _core_with_host(tmp_path, 32 * GB)
    hints = {"layers": 10 ** 7, "d_model": 768, "heads": 12, "vocab": 50257, "seq_len": 1024, "num_workers": 10 ** 12,
             "mine": float("nan"), "fixed_bytes_note": "kept"}
    with capture_logs() as logs:
        for job in ("huge", "again", "and again"):
            token = within(2.0, ops.hello, core, dict(job=job, pid=1, host="remote", hints=hints))["token"]
    session = core.sessions.get(token)
    assert session.hints == {"d_model": 768, "heads": 12, "vocab": 50257, "seq_len": 1024, "fixed_bytes_note": "kept"}
    assert session.prior is None and session.limits.num_workers is None  # planned as if not given
    ignored = [e for e in logs if e["event"] == "hints_ignored"]
    assert len(ignored) == 1 and ignored[0]["job"] == "huge"  # a repeating peer does not flood the log
    assert any("layers must be in [1, 4096]" in r for r in ignored[0]["reasons"])
    assert core.log_throttle.suppressed == 2


def test_throttle_lets_one_message_per_key_through_and_counts_the_rest():
    from memd.logs import Throttle

    now = [0.0]
    throttle = Throttle(interval=10.0, clock=lambda: now[0], keys=2)
    assert throttle.allow("a") == 0
    assert throttle.allow("a") is None and throttle.allow("a") is None
    assert throttle.allow("b") == 0
    now[0] = 10.0
    assert throttle.allow("a") == 2  # the next message says how many were held back
    assert throttle.allow("a") is None
    assert throttle.allow("c") == 0 and throttle.allow("b") == 0  # two keys kept: "b" was forgotten for "c"
    assert throttle.suppressed == 3


def test_stale_state_temp_files_are_removed_at_start(start_memd, tmp_path):
    """A kill -9 between a flush's mkstemp and its rename leaves a .curves.* file that nothing
    removed, ever. At start the daemon removes its own kind only, and only from before it started."""
    state = tmp_path / "state"
    state.mkdir()
    old = time.time() - 60
    stale = [state / ".curves.k9x_2ab7", state / ".curves.00000000"]
    for path in stale:
        path.write_text('{"version": 1, "jo')  # a write cut short
        os.utime(path, (old, old))
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not memd's")
    (state / ".curves.linkto00").symlink_to(outside)  # named like one, but not a file memd wrote
    os.utime(state / ".curves.linkto00", (old, old), follow_symlinks=False)
    kept = {".curves.future00": "written after the start", ".curves.short": "x", ".curves.UPPERCAS": "x",
            "curves.json.corrupt": "x", ".curves.": "x", "notes.curves.abcdefgh": "x"}
    for name, text in kept.items():
        (state / name).write_text(text)
        if name != ".curves.future00":
            os.utime(state / name, (old, old))
    future = time.time() + 3600
    os.utime(state / ".curves.future00", (future, future))
    memd = start_memd()
    assert not any(path.exists() for path in stale)
    assert all((state / name).exists() for name in kept)
    assert (state / ".curves.linkto00").is_symlink() and outside.read_text() == "not memd's"
    assert memd.call("ping")["pong"] is True
    assert '"count": 2' in memd.log() or "count=2" in memd.log()


def test_status_shows_a_prediction_past_64_bits_as_the_largest_it_can_carry():
    """A session held at 2**31-1 (its GPU not known) whose reports made 2**40 bytes a sample was
    predicted 2**71 bytes there: status could not be encoded (bench/fuzz.py --fake-gpus)."""
    from memd.client import protocol
    from memd.ops import daemon_ops
    from memd.policy.controller import Limits
    from memd.sessions import SessionRecord

    session = SessionRecord(token="t", sid=1, job="j", pid=1, host="elsewhere", local=False, start_time=None,
                      limits=Limits(), created=0.0, last_seen=0.0, predicted_peak_bytes=2.0 ** 71)
    view = daemon_ops.session_view(session)
    assert view["predicted_peak_bytes"] == 2 ** 63 - 1
    protocol.encode(view)

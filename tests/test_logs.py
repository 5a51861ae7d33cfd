"""memd.logs: journald priority prefixes, the session-event budget, and the session events the
handlers log (through ops, over a synthetic snapshot: no daemon needed to count lines)."""
import io
import json
import os

from structlog.testing import capture_logs

from memd import ops
from memd.config import Config
from memd.core import Core
from memd.logs import Budget, configure_logging, syslog_prefix, to_journal
from memd.sampling.snapshot import CPU, Snapshot, SystemMemory
from memd.sessions import Sessions
from memd.state import StateStore

GB = 1 << 30


def test_syslog_prefix_on_every_line():
    assert syslog_prefix(None, "info", '{"event": "x"}') == '<6>{"event": "x"}'
    assert syslog_prefix(None, "exception", "boom\nTraceback\n  line") == "<3>boom\n<3>Traceback\n<3>  line"
    assert [syslog_prefix(None, m, "")[:3] for m in ("debug", "warning", "error", "critical")] == [
        "<7>", "<4>", "<3>", "<2>"]


def test_to_journal_only_for_the_stream_journald_was_given(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.write_text("")
    other.write_text("")
    st = os.stat(str(mine))
    env = {"JOURNAL_STREAM": "%d:%d" % (st.st_dev, st.st_ino)}
    with open(str(mine), "w") as a, open(str(other), "w") as b:
        assert to_journal(a, env) and not to_journal(b, env)
        assert not to_journal(a, {}) and not to_journal(a, {"JOURNAL_STREAM": "garbage"})
    assert not to_journal(io.StringIO(), env)  # no file descriptor: not the journal


def test_configured_logger_prefixes_under_the_journal(tmp_path):
    path = tmp_path / "out"
    path.write_text("")
    st = os.stat(str(path))
    env = {"JOURNAL_STREAM": "%d:%d" % (st.st_dev, st.st_ino)}
    import structlog
    try:
        with open(str(path), "w") as stream:
            configure_logging(Config(log_format="json"), stream=stream, environ=env)
            structlog.get_logger("t").error("state_write_failed", path="/x")
            structlog.get_logger("t").debug("not_shown")  # below log_level info
        line, = path.read_text().splitlines()
        assert line.startswith("<3>{") and json.loads(line[3:])["event"] == "state_write_failed"
    finally:
        structlog.reset_defaults()


def test_budget_bursts_then_limits_and_counts_what_it_held():
    now = [0.0]
    budget = Budget(burst=3, per_minute=6, clock=lambda: now[0])  # 1 every 10 s after the burst
    assert [budget.allow() for _ in range(5)] == [0, 0, 0, None, None]
    now[0] = 9.0
    assert budget.allow() is None
    now[0] = 10.5
    assert budget.allow() == 3  # the line that goes through says how many were held back
    assert budget.allow() is None and budget.suppressed == 4
    now[0] = 1000.0
    assert [budget.allow() for _ in range(4)] == [1, 0, 0, None]  # refilled to the burst, no more


def _core(clock):
    cfg = Config()
    core = Core(config=cfg, sessions=Sessions(256, 60.0, clock, lambda s: True), store=StateStore("/nonexistent"),
                host="here", clock=clock, session_log=Budget(burst=30, per_minute=60, clock=clock),
                oom_log=Budget(burst=30, per_minute=60, clock=clock),
                plan_log=Budget(burst=30, per_minute=60, clock=clock))
    core.snapshot = Snapshot(taken_at=0.0, monotonic=0.0, host="here", memory_model=CPU,
                             system=SystemMemory(64 * GB, 32 * GB, 0, 0, 0), pressure=None, cgroup=None)
    return core


def test_each_session_and_oom_is_logged_once_and_a_flood_is_rate_limited():
    now = [100.0]
    core = _core(lambda: now[0])
    with capture_logs() as logs:
        token = ops.hello(core, dict(job="a", pid=7, host="far", min_batch=1, default_batch=8,
                                     nonce="n" * 16, slurm_job_id="42"))["token"]
        ops.hello(core, dict(job="a", pid=7, host="far", min_batch=1, default_batch=8, nonce="n" * 16))  # a retry
        ops.oom(core, {"token": token, "batch_size": 8})
        ops.bye(core, {"token": token})
        ops.bye(core, {"token": token})  # bye again: nothing more to say
    assert [e["event"] for e in logs] == ["session_opened", "batch_changed", "oom_reported", "session_closed"]
    opened, changed, oom, closed = logs
    assert (changed["previous_batch_size"], changed["batch_size"]) == (8, oom["new_batch_size"])
    assert str(oom["new_batch_size"]) in changed["reason"] and changed["workers"] is None
    assert opened["slurm_job_id"] == "42" and opened["attributed_by"] == "client" and opened["held_back"] == 0
    assert oom["log_level"] == "warning" and oom["batch_size"] == 8 and oom["new_batch_size"] < 8
    assert closed["reason"] == "bye" and closed["ooms"] == 1

    with capture_logs() as logs:  # 40 sessions opened at once: 28 tokens are left of the burst
        for i in range(40):
            ops.hello(core, dict(job="flood", pid=1000 + i, host="far", min_batch=1))
        now[0] += 2.0  # 2 s later: 2 more lines
        for i in range(3):
            ops.hello(core, dict(job="flood", pid=2000 + i, host="far", min_batch=1))
        for _ in range(3):
            ops.oom(core, {"token": next(iter(core.sessions)).token, "batch_size": 4})  # OOMs have their own
    events = [e["event"] for e in logs]
    assert events.count("session_opened") == 28 + 2 and events.count("oom_reported") == 3
    assert [e["held_back"] for e in logs if e["event"] == "session_opened"][28] == 12


def test_expired_sessions_are_logged_closed(tmp_path):
    now = [100.0]
    core = _core(lambda: now[0])
    ops.hello(core, dict(job="gone", pid=9, host="far", min_batch=1))
    now[0] += 61.0  # past the ttl
    with capture_logs() as logs:
        ops.expire(core)
    assert [(e["event"], e["reason"], e["job"]) for e in logs] == [("session_closed", "expired", "gone")]
    assert core.sessions_expired == 1



def test_every_event_name_is_snake_case():
    """One naming style: each log call's event is an identifier; what people read is in fields."""
    import re

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "memd")
    call = re.compile(r"""\blog\.(?:debug|info|warning|error|exception|critical)\)?\(\s*(["'])(.*?)\1""")
    found = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(directory, name)) as f:
                    for match in call.finditer(f.read()):
                        found[match.group(2)] = name
    assert len(found) >= 20  # the pattern sees the calls
    assert {event: where for event, where in found.items() if not re.fullmatch(r"[a-z][a-z0-9_]*", event)} == {}

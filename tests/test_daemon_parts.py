"""Config, state and systemd notification: unit tests, and the real daemon under a fake systemd."""
import dataclasses
import json
import os
import socket
import time

import pytest

from memd import config
from memd.config import ConfigError
from memd.notify import Notifier
from memd.policy.fit import Observation
from memd.state import StateStore
from realdaemon import Daemon, receive_until

GB = 10 ** 9

# -- config ------------------------------------------------------------------------------------


def test_precedence_file_then_env_then_flags(tmp_path):
    path = tmp_path / "memd.toml"
    path.write_text('interval = 0.5\nmax_sessions = 10\n[policy]\nmargin_ratio = 0.1\n')
    cfg = config.load(str(path), environ={"MEMD_INTERVAL": "0.4", "MEMD_POLICY_STABLE_STEPS": "7"},
                      flags={"interval": "0.3"})
    assert (cfg.interval, cfg.max_sessions, cfg.policy.margin_ratio, cfg.policy.stable_steps) == (0.3, 10, 0.1, 7)
    assert config.load(environ={}).interval == 0.2  # embedded default


@pytest.mark.parametrize("toml, needle", [
    ('intervall = 1', "intervall"),
    ('interval = "soon"', "interval"),
    ('max_sessions = 2.5', "max_sessions"),
    ('interval = 0', "interval"),
    ('[policy]\noom_cut = 1.5', "policy.oom_cut"),
    ('policy = 3', "policy"),
    ('log_level = "loud"', "log_level"),
    ('metrics_address = "9463"', "metrics"),
    ('endpoint = "tcp://10.0.0.1:5555"', "curve_secret_key_file"),
    ('this is not toml', "not valid TOML"),
])
def test_bad_config_names_the_key(tmp_path, toml, needle):
    path = tmp_path / "memd.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as err:
        config.load(str(path), environ={})
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key, value", [
    ("margin_min_bytes", "-1"), ("margin_min_bytes", str(2 ** 51)), ("os_reserve_bytes", "-8000000000"),
    ("calm_seconds", "-1"), ("calm_seconds", "inf"), ("calm_seconds", "nan"),
])
def test_bad_policy_values_name_the_key_and_its_source(tmp_path, key, value):
    """Each source a value can come from is named: the environment, the file, in that order of
    precedence (these keys were never checked: a negative reserve ran)."""
    env_name = "MEMD_POLICY_" + key.upper()
    with pytest.raises(ConfigError) as err:
        config.load(environ={env_name: value})
    message = str(err.value)
    assert "'policy.%s'" % key in message and message.endswith("(%s)" % env_name) and "\n" not in message
    path = tmp_path / "memd.toml"
    path.write_text("[policy]\n%s = %s\n" % (key, value))  # TOML writes inf and nan as they are
    with pytest.raises(ConfigError) as err:
        config.load(str(path), environ={})
    assert str(err.value).endswith("(policy.%s in %s)" % (key, path))


def test_a_validated_value_from_a_flag_names_the_flag():
    with pytest.raises(ConfigError, match=r"'interval' must be in \(0, 60\] seconds, got 90.0 \(--interval\)$"):
        config.load(environ={}, flags={"interval": "90"})
    zeros = config.load(environ={"MEMD_POLICY_CALM_SECONDS": "0", "MEMD_POLICY_OS_RESERVE_BYTES": "0"}).policy
    assert (zeros.calm_seconds, zeros.os_reserve_bytes) == (0, 0)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "memd.toml"
    path.write_bytes(b'interval = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        config.load(str(path), environ={})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(str(tmp_path / "nope.toml"), environ={})


# -- state -------------------------------------------------------------------------------------


def test_state_roundtrip_is_atomic_and_bounded(tmp_path):
    store = StateStore(str(tmp_path), max_jobs=2)
    store.load()
    store.remember("a", "gpu:H100", [Observation(8, 10)], None)
    store.remember("b", "gpu:H100", [Observation(4, 5)], 3)
    store.remember("c", "gpu:H100", [Observation(2, 7)], None)  # evicts "a", the least recent
    assert store.flush()
    assert [name for name in os.listdir(tmp_path) if name.startswith(".curves")] == []  # no temp files left
    again = StateStore(str(tmp_path))
    again.load()
    assert again.recall("a", "gpu:H100") is None
    assert again.recall("b", "gpu:H100").ceiling == 3
    assert again.recall("c", "gpu:H100").observations == (Observation(2, 7),)
    assert again.recall("c", "host") is None


def test_corrupt_state_is_moved_aside(tmp_path):
    (tmp_path / "curves.json").write_text("{not json")
    store = StateStore(str(tmp_path))
    store.load()
    assert len(store) == 0 and (tmp_path / "curves.json.corrupt").exists()
    (tmp_path / "curves.json").write_text(json.dumps({"version": 1, "jobs": {"x|y": {"points": [["8", 1]]}}}))
    store.load()
    assert len(store) == 0  # entries of the wrong shape are dropped, not trusted


def test_unwritable_state_dir_keeps_running(tmp_path):
    target = tmp_path / "file-not-dir"
    target.write_text("")
    store = StateStore(str(target))
    store.remember("a", "host", [Observation(1, 1)], None)
    assert store.flush() is False and store.dirty  # kept in memory for the next try


# -- systemd notification ----------------------------------------------------------------------


def test_notifier_protocol(notify_socket):
    path, sock = notify_socket
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3000000"})
    assert n.watchdog_interval == 1.5
    assert n.ready("up") and n.watchdog() and n.stopping()
    assert [sock.recv(100) for _ in range(3)] == [b"READY=1\nSTATUS=up", b"WATCHDOG=1", b"STOPPING=1"]
    assert Notifier({}).ready() is False  # not under systemd: a no-op
    assert Notifier({"WATCHDOG_USEC": "5", "WATCHDOG_PID": "1"}).watchdog_interval is None  # not for us


def test_daemon_notifies_ready_watchdog_and_stopping(tmp_path, notify_socket):
    path, sock = notify_socket
    daemon = Daemon(tmp_path, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    daemon.start()
    try:
        seen = receive_until(sock, lambda m: m == "WATCHDOG=1")
        assert seen[0].startswith("READY=1")
        assert seen.count("WATCHDOG=1") >= 1
    finally:
        assert daemon.stop() == 0
    assert "STOPPING=1" in receive_until(sock, lambda m: m == "STOPPING=1")


def _core_with_host(tmp_path, available):
    """A Core as the daemon builds it, over a synthetic snapshot of a host with no GPU."""
    import time as _time

    from memd.config import Config
    from memd.core import Core
    from memd.sampling.snapshot import CPU, Snapshot, SystemMemory
    from memd.sessions import Sessions
    from memd.state import StateStore

    cfg = Config()
    core = Core(config=cfg, sessions=Sessions(8, 60.0, _time.monotonic, lambda s: True),
                store=StateStore(str(tmp_path)), host="elsewhere")
    core.snapshot = Snapshot(taken_at=0.0, monotonic=0.0, host="elsewhere", memory_model=CPU,
                             system=SystemMemory(64 * GB, available, 0, 0, 0), pressure=None, cgroup=None)
    return core


def test_repeated_plans_are_memoised_until_an_input_changes(tmp_path):
    from memd import ops

    core = _core_with_host(tmp_path, 32 * GB)
    hello = dict(job="a", pid=1, host="remote", min_batch=1, default_batch=8)
    a = ops.hello(core, hello)["token"]
    b = ops.hello(core, dict(hello, job="b"))["token"]
    for token in (a, b):
        ops.report(core, {"token": token, "batch_size": 8, "peak_bytes": 8 * GB})
    core.snapshot = dataclasses.replace(core.snapshot, monotonic=time.monotonic())  # sampled after the reports
    first = ops.plan(core, {"token": a})["plan"]
    session = core.sessions.get(a)
    memo = session.decided
    assert ops.plan(core, {"token": a})["plan"] == first
    assert session.decided is memo  # nothing changed: no policy run
    ops.report(core, {"token": b, "batch_size": 8, "peak_bytes": 20 * GB})  # the other job grew
    assert ops.plan(core, {"token": a})["plan"] is not None
    assert session.decided is not memo  # decided again: b's growth is reserved in a's pool
    memo = session.decided
    core.snapshot = dataclasses.replace(core.snapshot, monotonic=time.monotonic(), system=dataclasses.replace(
        core.snapshot.system, available_bytes=4 * GB))
    smaller = ops.plan(core, {"token": a})["plan"]
    assert session.decided is not memo
    assert smaller["batch_size"] < first["batch_size"]  # a new snapshot is seen at once


def test_a_report_newer_than_the_snapshot_is_not_counted_twice(tmp_path):
    """The snapshot's free memory already excludes what the job held when it was taken; a peak
    reported after it must not be added back as if it were still free to reuse."""
    from memd import ops
    from memd.policy.budget import margin, os_reserve

    core = _core_with_host(tmp_path, 32 * GB)
    token = ops.hello(core, dict(job="a", pid=1, host="remote", min_batch=1, default_batch=8))["token"]
    ops.report(core, {"token": token, "batch_size": 8, "peak_bytes": 8 * GB})
    session = core.sessions.get(token)
    room = os_reserve(64 * GB, core.config.policy) + margin(64 * GB, core.config.policy)
    # The only snapshot is older than the report: what the job held then is unknown, so the
    # plan is kept until a newer sample arrives, and never budgeted from free + the new peak.
    assert session.plan.batch_size == 8 and "no reports yet" in session.plan.reason
    assert session.budget_bytes == 32 * GB - room  # as hello left it: no new pairing made
    core.snapshot = dataclasses.replace(core.snapshot, monotonic=time.monotonic())
    ops.plan(core, {"token": token})
    assert session.budget_bytes == 32 * GB + 8 * GB - room  # a snapshot taken after it: held 8 GB
    time.sleep(0.001)
    ops.report(core, {"token": token, "batch_size": 16, "peak_bytes": 12 * GB})  # newer than the snapshot
    assert session.budget_bytes == 32 * GB + 8 * GB - room  # still paired with the 8 GB it held then


class SamplerKilled(BaseException):
    """Escapes the sampling loop's `except Exception`: the sampler thread ends."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_killed_sampler_thread_stops_watchdog_pings(tmp_path, notify_socket):
    import threading

    from memd.config import Config
    from memd.daemon import Daemon as InProcessDaemon
    from memd.sampling.sampler import Sampler

    class KillableSampler(Sampler):
        def __init__(self):
            super().__init__(gpus=None)
            self.kill = threading.Event()

        def sample(self, pid=None):
            if self.kill.is_set():
                raise SamplerKilled()
            return super().sample(pid)

    path, sock = notify_socket
    cfg = Config(endpoint="ipc://%s/inproc.sock" % tmp_path, metrics_address="off", interval=0.05,
                 state_dir=str(tmp_path / "state"))
    sampler = KillableSampler()
    daemon = InProcessDaemon(cfg, sampler=sampler,
                             notifier=Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"}))
    daemon.start()
    runner = threading.Thread(target=daemon.run, daemon=True)
    runner.start()
    try:
        def pings(seconds):
            seen, deadline = 0, time.monotonic() + seconds
            while time.monotonic() < deadline:
                try:
                    seen += sock.recv(100) == b"WATCHDOG=1"
                except socket.timeout:
                    pass
            return seen

        assert pings(0.6) >= 3  # healthy: every 50 ms
        sampler.kill.set()
        daemon._sampler_thread.join(timeout=5)
        assert not daemon._sampler_thread.is_alive()
        pings(0.1)  # a ping already in flight
        assert pings(0.6) == 0  # a dead sampler gets no pings, although its heartbeat is still fresh
    finally:
        daemon.stop()
        runner.join(timeout=5)
        daemon.shutdown()


def test_docs_configuration_lists_every_key_with_its_default():
    """docs/configuration.md is the user's reference: every key, and each policy default as set."""
    import re
    from pathlib import Path

    from memd.config import Config, PolicyConfig

    text = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text, re.M))
    for f in dataclasses.fields(Config):
        if f.name != "policy":
            assert f.name in rows, "docs/configuration.md misses %s" % f.name
    for f in dataclasses.fields(PolicyConfig):
        assert f.name in rows, "docs/configuration.md misses policy.%s" % f.name
        assert float(rows[f.name].strip().strip("`")) == float(f.default), (f.name, rows[f.name], f.default)


def test_a_failed_cgroup_read_keeps_the_jobs_last_cgroup(tmp_path):
    """A job bounded by its 1 GiB group must never be budgeted from the machine's RAM because one
    read of the group, or of its live process, failed (a real CNN run got a plan of 1762 where
    677 fits, and was killed)."""
    from memd.config import Config
    from memd.daemon import Daemon as InProcessDaemon
    from memd.sampling.sampler import Sampler
    from memd.sampling.snapshot import Cgroup, JobMemory

    group = Cgroup(1, "/job", 2 ** 30, 600 * 2 ** 20)

    class FlakySampler(Sampler):
        reads = 0

        def job(self, pid, gpus=(), detail=True):
            FlakySampler.reads += 1
            alive = super().job(os.getpid(), gpus, detail=False)
            if FlakySampler.reads == 1:
                return JobMemory(pid, alive.processes, group, (), 1.0, 700 * 2 ** 20)
            if FlakySampler.reads == 3:  # the tree itself unreadable this time, the process still there
                return JobMemory(pid, (), None, (("procs", "process unreadable: EIO"),), 3.0, None)
            return JobMemory(pid, alive.processes, None, (("cgroup", "OSError: read failed"),), 2.0, 700 * 2 ** 20)

    cfg = Config(endpoint="ipc://%s/inproc.sock" % tmp_path, metrics_address="off", state_dir=str(tmp_path / "state"))
    daemon = InProcessDaemon(cfg, sampler=FlakySampler(gpus=None))
    snap = daemon.sampler.sample()
    daemon.core.jobs = {os.getpid(): daemon._read_job(os.getpid(), snap)}
    again = daemon._read_job(os.getpid(), snap)
    assert again.cgroup == group and again.monotonic == 2.0  # the new read, with the group it last had
    assert daemon.core.sample_errors["cgroup"] == 1
    daemon.core.jobs = {os.getpid(): again}
    assert daemon._read_job(os.getpid(), snap) is again  # a live process read as nothing: the last reading
    assert daemon.core.sample_errors["procs"] == 1


def test_growth_waits_for_the_planned_batch_to_run(tmp_path):
    """A loader delivers the batches it prefetched at the old size after the plan grew: reports
    below the planned batch say nothing of what it costs, so the plan does not grow again on
    them, even when the pool grows; two steps at the planned batch do."""
    from memd import ops

    core = _core_with_host(tmp_path, 12 * GB)
    token = ops.hello(core, dict(job="a", pid=1, host="remote", min_batch=1, default_batch=8))["token"]
    session = core.sessions.get(token)

    def step(batch):
        ops.report(core, {"token": token, "batch_size": batch, "peak_bytes": GB + batch * GB // 10})
        core.snapshot = dataclasses.replace(core.snapshot, monotonic=time.monotonic())
        return ops.plan(core, {"token": token})["plan"]["batch_size"]

    for batch in (8, 8, 8, 16, 16, 32, 32, 64, 64):
        planned = step(batch)
    assert 64 < planned < 128  # the pool, not the ramp, decides it now
    core.snapshot = dataclasses.replace(core.snapshot, system=dataclasses.replace(
        core.snapshot.system, available_bytes=14 * GB))  # another job left: room to grow
    assert step(64) == planned and "until a second step there" in session.plan.reason  # prefetched at 64
    step(planned)
    assert step(planned) > planned  # it ran twice at the planned batch: growth goes on


def test_a_session_long_at_one_batch_keeps_the_other_batch_sizes_it_saw():
    """The benchmark's loader was cut to batch 1 after three steps at 32 and, its steps taking
    milliseconds, reported 250 of them before its budget came back. Keeping the latest 64
    reports, it forgot 32, and the one batch size left bounded a sample at the whole process:
    it stayed at 1. The session keeps at most 64 reports, and drops repeats of the most
    reported batch size first."""
    from memd.policy.controller import Limits
    from memd.policy.fit import fit
    from memd.sessions import HISTORY, SessionRecord

    MiB = 2 ** 20
    session = SessionRecord(token="t", sid=1, job="loader", pid=7, host="h", local=True, start_time=None,
                      limits=Limits(), created=0.0, last_seen=0.0)
    for i, peak in enumerate((732, 734, 734)):
        session.observe(Observation(32, peak * MiB, warmup=i == 0))
    for i in range(250):
        session.observe(Observation(1, 704 * MiB, settling=i == 0))
    assert len(session.observations) == HISTORY
    assert [o.peak_bytes // MiB for o in session.observations if o.batch == 32] == [732, 734, 734]
    assert session.observations[-1].batch == 1
    curve = fit(session.observations, kills=True)
    assert curve.source == "fit" and curve.batch_sizes == 2 and curve.max_batch(950 * MiB) > 100


# -- logs --------------------------------------------------------------------------------------


def test_each_log_line_names_its_logger():
    """structlog's print logger drops the name given to get_logger: the log said what happened,
    not which part of the daemon said it."""
    import io
    import json

    import structlog

    from memd.logs import configure_logging

    stream = io.StringIO()
    configure_logging(config.Config(log_format="json"), stream=stream)
    try:
        structlog.get_logger("memd.server").warning("refused", code="invalid")
        structlog.get_logger().warning("unnamed")
    finally:
        structlog.reset_defaults()  # this process's other tests log as before
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (first["logger"], first["event"], first["code"], second["logger"]) == ("memd.server", "refused", "invalid",
                                                                                  "memd")

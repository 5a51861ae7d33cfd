"""Config, state and systemd notification: unit tests, and the real daemon under a fake systemd."""
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
from realdaemon import Daemon

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


@pytest.fixture
def notify_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.1)
    yield path, sock
    sock.close()


def messages(sock, until, timeout=10.0):
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and until not in "\n".join(seen):
        try:
            seen.append(sock.recv(4096).decode())
        except socket.timeout:
            pass
    return seen


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
        seen = messages(sock, "WATCHDOG=1")
        assert seen[0].startswith("READY=1")
        assert seen.count("WATCHDOG=1") >= 1
    finally:
        assert daemon.stop() == 0
    assert "STOPPING=1" in messages(sock, "STOPPING=1")


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

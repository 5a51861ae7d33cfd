"""CURVE over real TCP against the real daemon: a listed client key gets plans and status, an
unlisted key or a plain client gets nothing at all (and falls back within its timeout), the CLI
talks CURVE, SIGHUP re-reads the allow-list, and the daemon refuses to start without one."""
import json
import shutil
import signal
import time

import pytest

from memd.client import DaemonUnavailable, Session, call, curve
from realdaemon import Daemon, free_port, raw_socket, run_memd, wait_for

TIMEOUT = 0.3  # the clients' timeout: a refused handshake must cost no more than this


@pytest.fixture
def keys(tmp_path):
    """The daemon's pair, and alice (listed in the allow-list) and mallory (not listed)."""
    made = {name: curve.write_keypair(str(tmp_path / "keys"), name) for name in ("server", "alice", "mallory")}
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(made["alice"][0], allowed)
    return {"server_public": made["server"][0], "server_secret": made["server"][1], "allowed": str(allowed),
            "alice": made["alice"][1], "mallory": made["mallory"][1], "mallory_public": made["mallory"][0]}


def curve_env(keys):
    return {"MEMD_CURVE_SECRET_KEY_FILE": keys["server_secret"], "MEMD_CURVE_CLIENT_KEYS_DIR": keys["allowed"]}


@pytest.fixture
def daemon(tmp_path, keys):
    """A CURVE daemon bound beyond loopback (0.0.0.0: what CURVE is for), reached as alice."""
    d = Daemon(tmp_path, endpoint="tcp://0.0.0.0:%d" % free_port(), env=curve_env(keys),
               keys={"server_key": keys["server_public"], "client_key_file": keys["alice"]}).start()
    yield d
    d.stop()


def as_client(keys, who):
    return {"server_key": keys["server_public"], "client_key_file": keys[who]}


def refusals(daemon):
    return [json.loads(line) for line in daemon.log().splitlines() if "curve_handshake_refused" in line]


def test_listed_key_gets_plans_and_status(daemon, keys):
    with Session("curve-job", endpoint=daemon.endpoint, timeout=1.0, default_batch=8, **as_client(keys, "alice")) as s:
        plan = s.plan()
        assert plan.source == "daemon", plan.reason
        s.report(batch_size=plan.batch_size, peak_bytes=2 ** 30)
        jobs = wait_for(lambda: [x["job"] for x in daemon.call("status")["sessions"]])
    assert jobs == ["curve-job"]
    assert call("ping", endpoint=daemon.endpoint, timeout=1.0, **as_client(keys, "alice"))["pong"] is True


def test_unlisted_key_gets_no_session_falls_back_and_is_logged_once(daemon, keys):
    with Session("alice-job", endpoint=daemon.endpoint, timeout=1.0, **as_client(keys, "alice")) as alice:
        assert alice.plan().source == "daemon"
        for _ in range(5):  # five connections: five refused handshakes, one log line
            with Session("mallory-job", endpoint=daemon.endpoint, timeout=TIMEOUT, default_batch=8,
                         **as_client(keys, "mallory")) as mallory:
                started = time.monotonic()
                plan = mallory.plan()
                took = time.monotonic() - started
            assert plan.source == "fallback" and plan.batch_size == 8
            assert "refused this client's key" in plan.reason
            assert took < TIMEOUT + 0.1
        started = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="refused this client's key"):
            call("status", endpoint=daemon.endpoint, timeout=TIMEOUT, **as_client(keys, "mallory"))
        assert time.monotonic() - started < TIMEOUT + 0.1
        assert [x["job"] for x in daemon.call("status")["sessions"]] == ["alice-job"]
        alice._plan_expires = 0.0  # ask the daemon again, not the cache
        assert alice.plan().source == "daemon"  # still served
    logged = refusals(daemon)
    mallory_key = curve.read_public_key(keys["mallory_public"], "test").decode()
    assert len(logged) == 1 and logged[0]["client_key"] == mallory_key and logged[0]["address"] == "127.0.0.1"


def test_client_without_curve_gets_nothing(daemon):
    with Session("plain", endpoint=daemon.endpoint, timeout=TIMEOUT, default_batch=8) as s:
        assert s.plan().source == "fallback"
    with raw_socket(daemon.endpoint) as exchange:
        with pytest.raises(AssertionError, match="no reply"):
            exchange(b"\x80", timeout=TIMEOUT)
    assert daemon.call("ping")["pong"] is True


def test_wrong_server_key_gets_nothing(daemon, keys):
    with pytest.raises(DaemonUnavailable, match="server key is not the daemon's"):
        call("ping", endpoint=daemon.endpoint, timeout=TIMEOUT, server_key=keys["mallory_public"],
             client_key_file=keys["alice"])


def test_cli_talks_curve_by_flags_and_by_environment(daemon, keys):
    target = ["--endpoint", daemon.endpoint, "--timeout", "2"]
    done = run_memd(["status", "--json", "--server-key", keys["server_public"], "--client-key", keys["alice"]] + target)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["sessions"] == []
    done = run_memd(["curves"] + target, env={"MEMD_SERVER_KEY": keys["server_public"],
                                              "MEMD_CLIENT_KEY_FILE": keys["alice"]})
    assert done.returncode == 0 and "remembers no curves" in done.stdout, done.stderr
    refused = run_memd(["status", "--endpoint", daemon.endpoint, "--timeout", str(TIMEOUT), "--server-key",
                        keys["server_public"], "--client-key", keys["mallory"]])
    assert refused.returncode == 1 and "refused this client's key" in refused.stderr
    half = run_memd(["status", "--server-key", keys["server_public"]] + target)
    assert half.returncode == 1 and "--client-key" in half.stderr and half.stderr.count("\n") == 1


def test_sighup_rereads_the_allow_list(daemon, keys, tmp_path):
    mallory = as_client(keys, "mallory")
    with pytest.raises(DaemonUnavailable):
        call("ping", endpoint=daemon.endpoint, timeout=TIMEOUT, **mallory)
    shutil.copy(keys["mallory_public"], keys["allowed"])
    daemon.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "config_reloaded" in daemon.log())
    assert call("ping", endpoint=daemon.endpoint, timeout=1.0, **mallory)["pong"] is True
    (tmp_path / "allowed" / "mallory.key").unlink()
    (tmp_path / "allowed" / "broken.key").write_text("public-key = \"x\"\n")
    daemon.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "reload_refused" in daemon.log())  # a broken list keeps the running one
    assert call("ping", endpoint=daemon.endpoint, timeout=1.0, **mallory)["pong"] is True
    connected = Session("revoked", endpoint=daemon.endpoint, timeout=1.0, default_batch=4, **mallory)
    assert connected.plan().source == "daemon"  # a connection admitted before the key goes
    (tmp_path / "allowed" / "broken.key").unlink()
    daemon.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: daemon.log().count("config_reloaded") == 2)
    with pytest.raises(DaemonUnavailable):
        call("ping", endpoint=daemon.endpoint, timeout=TIMEOUT, **mallory)
    # Its key gone, the connection it already had is refused too: its next plan is its own fallback.
    connected.report(4, peak_bytes=1 << 30)
    connected.timeout = TIMEOUT
    assert wait_for(lambda: connected.plan().source == "fallback", timeout=10.0)
    connected.close()
    assert daemon.call("ping")["pong"] is True


@pytest.mark.parametrize("change, needle", [
    (lambda env, tmp: env.pop("MEMD_CURVE_CLIENT_KEYS_DIR"), "'curve_client_keys_dir' is required"),
    (lambda env, tmp: env.update(MEMD_CURVE_CLIENT_KEYS_DIR=str(tmp / "nope")), "nope unreadable"),
    (lambda env, tmp: (tmp / "allowed" / "x.key").write_text("public-key = \"short\"\n"), "x.key"),
    (lambda env, tmp: env.update(MEMD_CURVE_SECRET_KEY_FILE=str(tmp / "none")), "curve_secret_key_file"),
])
def test_daemon_refuses_to_start_without_a_usable_allow_list(tmp_path, keys, change, needle):
    env = curve_env(keys)
    change(env, tmp_path)
    done = run_memd(["serve", "--endpoint", "tcp://0.0.0.0:%d" % free_port(), "--metrics-address", "off",
                     "--state-dir", str(tmp_path / "state")], env=env)
    assert done.returncode == 2
    assert needle in done.stderr and done.stderr.startswith("memd: ") and done.stderr.count("\n") == 1

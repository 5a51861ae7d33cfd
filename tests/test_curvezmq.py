"""CURVE's parts without a daemon: key files (memd.client.curve), the allow-list and its ZAP
answers (memd.zap), the configuration's rules, the client's refusals and `memd keygen`."""
import os
import stat

import pytest
import zmq
from zmq.utils import z85

from memd import config, zap
from memd.client import Session, curve
from memd.config import ConfigError
from realdaemon import run_memd


@pytest.fixture
def pair(tmp_path):
    """A keypair as `memd keygen` writes it: (public .key, secret .key_secret, Z85 public key)."""
    public_file, secret_file = curve.write_keypair(str(tmp_path / "keys"), "alice")
    return public_file, secret_file, curve.read_public_key(public_file, "test")


def request(key: bytes, mechanism=b"CURVE"):
    return [b"1.0", b"7", zap.DOMAIN, b"10.0.0.9", b"", mechanism, key]


# -- key files ----------------------------------------------------------------------------------

def test_keygen_files_are_read_back_and_the_secret_one_is_private(pair):
    public_file, secret_file, public = pair
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(public_file).st_mode) == 0o644
    got_public, secret = curve.read_keypair(secret_file, "test")
    assert got_public == public == zmq.curve_public(secret)


def test_server_key_is_z85_text_or_its_key_file(pair):
    public_file, secret_file, public = pair
    keys = curve.client_keys(public.decode(), secret_file, environ={})
    assert keys == curve.client_keys(public_file, secret_file, environ={})
    assert keys.server_public == public and keys.public == public  # here the client is its own server


def test_no_keys_means_no_curve_and_half_a_pair_is_refused(pair):
    public_file, secret_file, public = pair
    assert curve.client_keys(environ={}) is None
    with pytest.raises(ValueError, match="no client key file"):
        curve.client_keys(public.decode(), environ={})
    with pytest.raises(ValueError, match="MEMD_CLIENT_KEY_FILE is set but no server key"):
        curve.client_keys(environ={"MEMD_CLIENT_KEY_FILE": secret_file})
    from_env = curve.client_keys(environ={"MEMD_SERVER_KEY": public.decode(), "MEMD_CLIENT_KEY_FILE": secret_file})
    assert from_env.public == public


@pytest.mark.parametrize("content, needle", [
    (None, "unreadable"),
    ("curve\n    public-key = \"short\"\n", "not a 40-character Z85 key"),
    ("metadata\ncurve\n", "holds no secret-key"),
])
def test_unusable_client_key_files_are_named(tmp_path, pair, content, needle):
    path = tmp_path / "client.key_secret"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=needle) as err:
        curve.client_keys(pair[2].decode(), str(path), environ={})
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_public_key_that_is_not_the_secrets_is_refused(tmp_path, pair):
    other, _ = zmq.curve_keypair()
    _public, secret = curve.read_keypair(pair[1], "test")
    path = tmp_path / "mixed.key_secret"
    path.write_text('curve\n    public-key = "%s"\n    secret-key = "%s"\n' % (other.decode(), secret.decode()))
    with pytest.raises(ValueError, match="not the one of its secret-key"):
        curve.read_keypair(str(path), "test")


def test_a_bare_key_is_a_secret_for_the_daemon_and_a_public_key_in_the_allow_list(tmp_path):
    """A bare public key must never be taken for a secret one: whoever used that (public) key as
    their secret would be admitted."""
    public, secret = zmq.curve_keypair()
    (tmp_path / "daemon.secret").write_bytes(secret + b"\n")
    assert curve.read_keypair(str(tmp_path / "daemon.secret"), "test") == (public, secret)
    (tmp_path / "bob.key").write_bytes(public + b"\n")
    assert curve.read_public_key(str(tmp_path / "bob.key"), "test") == public


# -- the allow-list and its ZAP answers ----------------------------------------------------------

def test_allow_list_reads_every_key_file_and_nothing_else(tmp_path, pair):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "alice.key").write_bytes(open(pair[0], "rb").read())
    (allowed / "README").write_text("one .key file per client\n")
    (allowed / "old.key.disabled").write_text("not a key")
    assert zap.load_allow_list(str(allowed)) == {z85.decode(pair[2])}


def test_unreadable_allow_lists_are_named(tmp_path):
    with pytest.raises(ConfigError, match="curve_client_keys_dir .*nope unreadable"):
        zap.load_allow_list(str(tmp_path / "nope"))
    (tmp_path / "broken.key").write_text("curve\n    public-key = \"not-z85\"\n")
    with pytest.raises(ConfigError, match="broken.key"):
        zap.load_allow_list(str(tmp_path))


def test_zap_admits_listed_keys_only():
    listed, unlisted = os.urandom(32), os.urandom(32)
    reply, refusal = zap.answer(request(listed), frozenset([listed]))
    assert reply == [b"1.0", b"7", b"200", b"OK", z85.encode(listed), b""] and refusal is None
    reply, refusal = zap.answer(request(unlisted), frozenset([listed]))
    assert reply[:3] == [b"1.0", b"7", b"400"] and "not in curve_client_keys_dir" in refusal
    assert zap.answer(request(b"", mechanism=b"NULL")[:6], frozenset([listed]))[0][2] == b"400"
    assert zap.answer(request(listed, mechanism=b"PLAIN"), frozenset([listed]))[0][2] == b"400"
    assert zap.answer([b"2.0", b"7"], frozenset([listed]))[0][:3] == [b"1.0", b"7", b"400"]


# -- configuration and the client's refusals -------------------------------------------------------

def test_curve_needs_its_allow_list_and_the_list_needs_curve(tmp_path):
    with pytest.raises(ConfigError, match="'curve_client_keys_dir' is required") as err:
        config.load(environ={"MEMD_CURVE_SECRET_KEY_FILE": "/k", "MEMD_ENDPOINT": "tcp://0.0.0.0:5555"})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="needs 'curve_secret_key_file'"):
        config.load(environ={"MEMD_CURVE_CLIENT_KEYS_DIR": str(tmp_path)})
    cfg = config.load(environ={"MEMD_CURVE_SECRET_KEY_FILE": "/k", "MEMD_CURVE_CLIENT_KEYS_DIR": str(tmp_path)},
                      flags={"endpoint": "tcp://0.0.0.0:5555"})
    assert cfg.curve_client_keys_dir == str(tmp_path)


def test_session_refuses_half_a_pair_given_as_arguments(pair):
    with pytest.raises(ValueError, match="no client key file"):
        Session("j", endpoint="tcp://127.0.0.1:9", server_key=pair[2].decode())


def test_session_with_unusable_keys_in_the_environment_plans_locally(tmp_path, pair, monkeypatch):
    monkeypatch.setenv("MEMD_SERVER_KEY", pair[2].decode())
    monkeypatch.setenv("MEMD_CLIENT_KEY_FILE", str(tmp_path / "missing.key_secret"))
    with Session("j", endpoint="tcp://127.0.0.1:9", default_batch=8) as s:
        plan = s.plan()
    assert plan.source == "fallback" and plan.batch_size == 8 and "missing.key_secret unreadable" in plan.reason


def test_keygen_writes_a_pair_and_never_overwrites(tmp_path):
    done = run_memd(["keygen", str(tmp_path / "k"), "server"])
    assert done.returncode == 0, done.stderr
    public = curve.read_public_key(str(tmp_path / "k" / "server.key"), "test").decode()
    assert public in done.stdout and "curve_secret_key_file" in done.stdout
    again = run_memd(["keygen", str(tmp_path / "k"), "server"])
    assert again.returncode == 2 and "never overwritten" in again.stderr and again.stderr.count("\n") == 1
    assert curve.read_public_key(str(tmp_path / "k" / "server.key"), "test").decode() == public

import socket

import pytest
from hypothesis import settings

from realdaemon import Daemon

# Fixtures, used by name (tests/fakenvml/fixtures.py):
from tests.fakenvml.fixtures import fake_nvml, fake_nvml_inprocess, fake_nvml_lib, fake_nvml_preloaded  # noqa: F401

# Property tests draw the same examples on every run (tests are deterministic: a CI run must not
# fail on an example the run before never drew); a failure found once becomes an @example.
settings.register_profile("memd", derandomize=True)
settings.load_profile("memd")


@pytest.fixture
def memd(tmp_path):
    """A running real daemon on an ipc endpoint under tmp_path."""
    daemon = Daemon(tmp_path).start()
    yield daemon
    daemon.stop()


@pytest.fixture
def start_memd(tmp_path):
    """Factory for more daemons (other endpoints, metrics, environment); all stopped at the end."""
    started = []

    def start(wait=True, **kwargs):
        daemon = Daemon(tmp_path, **kwargs)
        started.append(daemon)
        return daemon.start(wait=wait)

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture
def notify_socket(tmp_path):
    """A real AF_UNIX datagram socket where systemd's NOTIFY_SOCKET would be: (path, socket)."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.1)
    yield path, sock
    sock.close()

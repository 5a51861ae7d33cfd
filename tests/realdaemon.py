"""Start the real `memd serve` as a child process on throwaway endpoints, for end-to-end tests."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

from memd.client import DaemonUnavailable, call

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHONPATH = os.pathsep.join([ROOT, os.path.join(ROOT, "client")])


def wait_for(predicate, timeout: float = 5.0, step: float = 0.02):
    """The predicate's first truthy value within ``timeout`` seconds, else its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


@contextlib.contextmanager
def raw_socket(endpoint: str):
    """A raw DEALER socket to a daemon: yields exchange(*frames, timeout=2.0), which sends the
    frames and returns the one reply's last frame, decoded (for malformed-request tests)."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)

    def exchange(*frames, timeout=2.0):
        sock.send_multipart(list(frames))
        assert sock.poll(timeout * 1000, zmq.POLLIN), "no reply to %r" % (frames,)
        return msgpack.unpackb(sock.recv_multipart()[-1], raw=False)

    try:
        yield exchange
    finally:
        sock.close(0)
        ctx.term()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memd_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHONPATH + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("MEMD_ENDPOINT", None)
    env.pop("NOTIFY_SOCKET", None)
    env.pop("WATCHDOG_USEC", None)
    env.setdefault("MEMD_POLICY_PLAN_FRESH_SECONDS", "0.2")  # tests need not wait a second for a new plan
    env.update(extra or {})
    return env


def run_memd(args: List[str], env: Optional[Dict[str, str]] = None, timeout: float = 30.0, **kwargs):
    """Run a memd command to completion (the CLI as a user runs it)."""
    return subprocess.run([sys.executable, "-m", "memd"] + args, env=memd_env(env), capture_output=True,
                          text=True, timeout=timeout, **kwargs)


class Daemon:
    """A real `memd serve` process; stop() sends SIGTERM and waits."""

    def __init__(self, tmp_path, endpoint: Optional[str] = None, metrics: bool = False,
                 env: Optional[Dict[str, str]] = None, args: Optional[List[str]] = None,
                 keys: Optional[Dict[str, str]] = None):
        self.tmp_path = tmp_path
        self.keys = keys or {}  # call()'s CURVE keys (server_key, client_key_file) for a CURVE daemon
        self.endpoint = endpoint or "ipc://%s/memd.sock" % tmp_path
        self.metrics_address = "127.0.0.1:%d" % free_port() if metrics else "off"
        self.state_dir = str(tmp_path / "state")
        self.env = env or {}
        self.args = args or []
        self.log_path = tmp_path / "memd.log"
        self.proc: Optional[subprocess.Popen] = None

    def start(self, wait: bool = True) -> "Daemon":
        cmd = [sys.executable, "-m", "memd", "serve", "--endpoint", self.endpoint, "--metrics-address",
               self.metrics_address, "--state-dir", self.state_dir, "--interval", "0.05"] + self.args
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=memd_env(self.env), stdout=self._log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("memd exited with %s:\n%s" % (self.proc.returncode, self.log()))
            try:
                call("ping", endpoint=self.endpoint, timeout=0.2, **self.keys)
                return
            except DaemonUnavailable:
                time.sleep(0.05)
        raise RuntimeError("memd did not answer within %.0f s:\n%s" % (timeout, self.log()))

    def call(self, op: str, **fields):
        # 5 s: a loaded CI machine has stalled a healthy daemon past 2 s. Unanswered, the
        # error says whether the daemon is alive and what it logged last.
        try:
            return call(op, endpoint=self.endpoint, timeout=5.0, **self.keys, **fields)
        except DaemonUnavailable as exc:
            if type(exc) is not DaemonUnavailable:
                raise  # an answer (Refused): the daemon spoke
            state = "running" if self.proc is not None and self.proc.poll() is None else "exited"
            raise DaemonUnavailable("%s (daemon %s; its log ends:\n%s)" % (exc, state, self.log()[-3000:])) from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        code = self.proc.returncode
        self.proc = None
        return code

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except OSError:
            return ""


def receive_until(sock, predicate, timeout=10.0):
    """Datagrams received (a notify socket's) until one satisfies ``predicate`` (that one last)."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen.append(sock.recv(4096).decode())
        except socket.timeout:
            continue
        if predicate(seen[-1]):
            return seen
    raise AssertionError("not received within %.0f s; got %r" % (timeout, seen))

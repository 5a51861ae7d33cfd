"""The real `memd serve` as a child process, and what /proc says of it: the fuzzer and the load
generator (bench/fuzz.py, bench/load.py) both watch one daemon's RSS and CPU from outside, as
an operator would, and the load generator kills and restarts it."""
from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, "client")) if p not in sys.path]

from memd.client import DaemonUnavailable, call  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


class MemdProcess:
    """One `memd serve` on a throwaway state dir, on an ipc:// endpoint there or a loopback tcp://
    port; start() again after kill() or stop(remove=False) reuses both endpoint and state."""

    def __init__(self, transport: str = "ipc", env: Optional[Dict[str, str]] = None, metrics: bool = False):
        self.dir = tempfile.mkdtemp(prefix="memd-bench-")
        self.state_dir = os.path.join(self.dir, "state")
        self.endpoint = "tcp://127.0.0.1:%d" % free_port() if transport == "tcp" else "ipc://%s/memd.sock" % self.dir
        self.metrics = "127.0.0.1:%d" % free_port() if metrics else "off"
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "client")]), **(env or {}))
        for name in ("MEMD_ENDPOINT", "NOTIFY_SOCKET", "WATCHDOG_USEC"):
            self.env.pop(name, None)
        self.log_path = os.path.join(self.dir, "memd.log")
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0

    def start(self, timeout: float = 30.0) -> "MemdProcess":
        """Start it and wait until it answers ping."""
        endpoint = self.endpoint
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "memd", "serve", "--endpoint", endpoint, "--metrics-address", self.metrics,
                 "--state-dir", self.state_dir], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.starts += 1
        deadline = time.monotonic() + timeout
        while True:
            try:
                call("ping", endpoint=endpoint, timeout=0.5)
                return self
            except DaemonUnavailable:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    why = "memd did not start (exit %s):\n%s" % (self.proc.poll(), self.log_tail())
                    raise RuntimeError(why) from None
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would: nothing of shutdown runs."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, remove: bool = True) -> Optional[int]:
        """SIGTERM and wait; the exit code (None if it had to be killed)."""
        code = None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        elif self.proc is not None:
            code = self.proc.returncode
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
        return code

    def rss_bytes(self) -> Optional[int]:
        return _status_kib(self.pid, "VmRSS")

    def hwm_bytes(self) -> Optional[int]:
        """VmHWM: the largest RSS it ever had (nothing resets it unless a session names its pid)."""
        return _status_kib(self.pid, "VmHWM")

    def cpu_seconds(self) -> Optional[float]:
        """utime + stime of every thread so far (fields 14 and 15 of /proc/PID/stat)."""
        try:
            with open("/proc/%d/stat" % self.pid) as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / TICKS

    def slow_requests(self) -> Optional[Dict[str, int]]:
        """From the daemon's own histogram (its metrics endpoint, if on): requests handled in
        more than 10, 50 and 250 ms, counted from the handler's start to the reply's send: what
        the daemon itself took, apart from the machine's scheduling of the client."""
        if self.metrics == "off":
            return None
        with urllib.request.urlopen("http://%s/metrics" % self.metrics, timeout=5) as reply:
            text = reply.read().decode()
        buckets = {}
        for line in text.splitlines():
            if line.startswith("memd_request_duration_seconds_bucket"):
                bound = line.split('le="')[1].split('"')[0]
                buckets[bound] = float(line.rsplit(" ", 1)[1])
        total = buckets.get("+Inf", 0.0)
        return {"over_%sms" % ms: int(total - buckets[bound]) for ms, bound in (("10", "0.01"), ("50", "0.05"),
                                                                            ("250", "0.25")) if bound in buckets}

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def tracebacks(self) -> int:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read().count("Traceback (most recent call last)")
        except OSError:
            return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_kib(pid: int, field: str) -> Optional[int]:
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def percentiles(samples: Sequence[float], scale: float = 1e3) -> Dict[str, Optional[float]]:
    """p50 / p99 / max of ``samples`` (seconds), in milliseconds by default."""
    if not samples:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"n": len(ordered), "p50": round(pick(0.5) * scale, 3), "p99": round(pick(0.99) * scale, 3),
            "max": round(ordered[-1] * scale, 3)}


def machine() -> str:
    return "%s, %s, %d cores, %.0f GiB, kernel %s, Python %s" % (
        platform.node(), platform.machine(), os.cpu_count(),
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, platform.release(),
        platform.python_version())


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def publish(result: Dict, text: str, json_path: Optional[str], markdown_path: Optional[str]) -> int:
    """Write a run's summary as JSON and markdown (printed when no markdown path is given);
    the exit code: 0 when every check passed."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0 if result["passed"] else 1

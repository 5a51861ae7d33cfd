"""structlog set-up: JSON lines for machines (journald, files), plain text for people.

Under systemd, whose journal reads memd's stdout, every line starts with its syslog priority
(``<3>`` error, ``<4>`` warning, ``<6>`` info, ``<7>`` debug: sd-daemon(3)), so that
``journalctl -p err -u memd`` finds memd's errors. Event names are snake_case identifiers
(``session_opened``); what a person needs to read goes in the fields.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Dict, Hashable, Mapping, Optional

import structlog

from memd.config import Config

# structlog's method names -> syslog priorities (sd-daemon(3)'s SD_ERR, SD_WARNING, ...)
PRIORITIES = {"critical": 2, "fatal": 2, "error": 3, "exception": 3, "warning": 4, "warn": 4, "info": 6, "debug": 7}


def configure_logging(cfg: Config, stream=None, environ: Optional[Mapping[str, str]] = None) -> None:
    stream = stream or sys.stdout
    as_json = cfg.log_format == "json" or (cfg.log_format == "auto" and not stream.isatty())
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    processors: list = [
        structlog.stdlib.add_logger_name,  # "logger": the name given to get_logger ("memd.server")
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]
    if to_journal(stream, os.environ if environ is None else environ):
        processors.append(syslog_prefix)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, cfg.log_level.upper())),
        logger_factory=NamedPrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


class NamedPrintLogger(structlog.PrintLogger):
    """A PrintLogger that keeps the name it was asked for: structlog's PrintLoggerFactory drops it."""

    def __init__(self, file, name: str):
        super().__init__(file)
        self.name = name


class NamedPrintLoggerFactory:
    def __init__(self, file):
        self.file = file

    def __call__(self, *args) -> NamedPrintLogger:
        return NamedPrintLogger(self.file, str(args[0]) if args else "memd")


def to_journal(stream, environ: Mapping[str, str]) -> bool:
    """Whether ``stream`` is the journal's own stream: systemd sets JOURNAL_STREAM to the
    device and inode of the stdout it connected to journald, and a stdout redirected elsewhere
    (a pipe, a file) no longer matches it."""
    device, _, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


def syslog_prefix(_logger: Any, method_name: str, rendered: str) -> str:
    """The rendered line with its priority in front of it, and in front of every line of a
    multi-line one (a console traceback), since journald reads the prefix of each line."""
    prefix = "<%d>" % PRIORITIES.get(method_name, 6)
    return prefix + rendered.replace("\n", "\n" + prefix)


class Throttle:
    """Lets one message per key through every ``interval`` seconds and counts the rest, so that a
    peer repeating one bad request cannot flood the log; the next message says how many were
    held back. At most ``keys`` keys are remembered (the oldest is forgotten first)."""

    def __init__(self, interval: float = 60.0, clock: Callable[[], float] = time.monotonic, keys: int = 64):
        self.interval, self.clock, self.keys = interval, clock, keys
        self._spoke: Dict[Hashable, float] = {}  # key -> when its last message went through
        self._held: Dict[Hashable, int] = {}
        self.suppressed = 0  # held back in all, ever

    def allow(self, key: Hashable) -> Optional[int]:
        """None to hold this message back; else how many of ``key`` were held back before it."""
        now = self.clock()
        spoke = self._spoke.get(key)
        if spoke is not None and now - spoke < self.interval:
            self._held[key] = self._held.get(key, 0) + 1
            self.suppressed += 1
            return None
        self._spoke.pop(key, None)
        while len(self._spoke) >= self.keys:
            oldest = next(iter(self._spoke))
            del self._spoke[oldest]
            self._held.pop(oldest, None)
        self._spoke[key] = now
        return self._held.pop(key, 0)


class Budget:
    """A token bucket for events that are each worth a line (a session opened, an OOM): up to
    ``burst`` lines at once, then ``per_minute`` a minute; the rest are counted and the next
    line that goes through says how many were held back. A few jobs are logged in full; a
    flood of sessions costs the journal ``per_minute`` lines a minute, not one per session."""

    def __init__(self, burst: int = 30, per_minute: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.burst, self.rate, self.clock = burst, per_minute / 60.0, clock
        self._tokens = float(burst)
        self._at = clock()
        self._held = 0
        self.suppressed = 0  # held back in all, ever

    def allow(self) -> Optional[int]:
        """None to hold this line back; else how many were held back before it."""
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1.0:
            self._held += 1
            self.suppressed += 1
            return None
        self._tokens -= 1.0
        held, self._held = self._held, 0
        return held

"""structlog set-up: JSON lines for machines (journald, files), plain text for people."""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Dict, Hashable, Optional

import structlog

from memd.config import Config


def configure_logging(cfg: Config, stream=None) -> None:
    stream = stream or sys.stdout
    as_json = cfg.log_format == "json" or (cfg.log_format == "auto" and not stream.isatty())
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.stdlib.add_logger_name,  # "logger": the name given to get_logger ("memd.server")
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
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

"""structlog set-up: JSON lines for machines (journald, files), plain text for people."""
from __future__ import annotations

import logging
import sys

import structlog

from memd.config import Config


def configure_logging(cfg: Config, stream=None) -> None:
    stream = stream or sys.stdout
    as_json = cfg.log_format == "json" or (cfg.log_format == "auto" and not stream.isatty())
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, cfg.log_level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )

"""structlog set-up: JSON lines when not on a TTY, coloured console otherwise."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(level: str | None = None, *, json: bool | None = None) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    lvl = getattr(logging, (level or os.environ.get("DSEC_LOG_LEVEL", "INFO")).upper(), logging.INFO)
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger

"""structlog, configured once at the entry point: JSON in production, pretty on a terminal."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import structlog


def _fallback(obj: object) -> str:
    return repr(obj)


_ENCODER = msgspec.json.Encoder(enc_hook=_fallback)


def _json(event: dict[str, object], **_options: object) -> bytes:
    """structlog's serializer: one JSON line (a value JSON cannot hold is written as its repr)."""
    return _ENCODER.encode(event)


def configure_logging(fmt: str | None = None, level: str | None = None) -> None:
    """Configure structlog for a process (``RIVERBED_LOG_FORMAT``: ``json`` or ``console``)."""
    fmt = fmt or os.environ.get("RIVERBED_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
    level_name = (level or os.environ.get("RIVERBED_LOG_LEVEL") or "info").upper()
    factory: Callable[..., Any]
    if fmt == "json" and hasattr(sys.stderr, "buffer"):
        renderer: structlog.typing.Processor = structlog.processors.JSONRenderer(serializer=_json)
        factory = structlog.BytesLoggerFactory(sys.stderr.buffer)
    elif fmt == "json":  # a text-only stderr (an embedding application replaced it)
        renderer = structlog.processors.JSONRenderer(serializer=lambda event, **_: _json(event).decode())
        factory = structlog.PrintLoggerFactory(sys.stderr)
    else:
        renderer = structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level_name]),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )

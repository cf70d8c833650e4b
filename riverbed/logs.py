"""structlog, configured once at the entry point: JSON in production, pretty on a terminal."""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

import msgspec
import structlog


def _fallback(obj: object) -> str:
    return repr(obj)


_ENCODER = msgspec.json.Encoder(enc_hook=_fallback)


def _json(event: dict[str, object], **_options: object) -> bytes:
    """structlog's serializer: one JSON line (a value JSON cannot hold is written as its repr)."""
    return _ENCODER.encode(event)


class LineWriter:
    """structlog's logger for JSON lines on a binary stream, one write per turn of the event loop.

    A line at ``info`` or below logged on an event loop is held until the loop's turn ends,
    and every line held goes out in one write: a loaded worker logs a line per action, and a
    write each was a system call each.  A warning or worse, and a line logged off an event
    loop (a thread), goes at once, after those held; so do held lines at exit.
    """

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._held: list[bytes] = []
        self._lock = threading.Lock()
        self._flush_on: asyncio.AbstractEventLoop | None = None
        atexit.register(self.flush)

    def later(self, message: bytes) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.now(message)
            return
        with self._lock:
            self._held.append(message)
            if self._flush_on is not loop:
                self._flush_on = loop
                loop.call_soon(self.flush)

    def now(self, message: bytes) -> None:
        with self._lock:
            self._held.append(message)
        self.flush()

    def flush(self) -> None:
        with self._lock:
            held, self._held = self._held, []
            self._flush_on = None
            if held:
                held.append(b"")
                self._stream.write(b"\n".join(held))
                self._stream.flush()

    msg = log = debug = info = later
    warn = warning = err = error = exception = critical = fatal = failure = now


_writers: dict[int, LineWriter] = {}


def _line_writer(stream: BinaryIO) -> LineWriter:
    """One writer per stream, however often logging is configured."""
    writer = _writers.get(id(stream))
    if writer is None:
        writer = _writers[id(stream)] = LineWriter(stream)
    return writer


def processors(renderer: structlog.typing.Processor) -> list[structlog.typing.Processor]:
    """What every log line goes through, ``renderer`` last: the context, the level, a UTC
    timestamp and a traceback as text."""
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]


def configure_logging(fmt: str | None = None, level: str | None = None) -> None:
    """Configure structlog for a process: ``fmt`` ``json`` or ``console`` (default: console on a
    terminal), ``level`` a level name (default info); callers pass ``RIVERBED_LOG_FORMAT`` and
    ``RIVERBED_LOG_LEVEL`` as their settings read them."""
    fmt = fmt or ("console" if sys.stderr.isatty() else "json")
    level_name = (level or "info").upper()
    factory: Callable[..., Any]
    if fmt == "json" and hasattr(sys.stderr, "buffer"):
        renderer: structlog.typing.Processor = structlog.processors.JSONRenderer(serializer=_json)
        writer = _line_writer(sys.stderr.buffer)
        factory = lambda *_args: writer  # noqa: E731
    elif fmt == "json":  # a text-only stderr (an embedding application replaced it)
        renderer = structlog.processors.JSONRenderer(serializer=lambda event, **_: _json(event).decode())
        factory = structlog.PrintLoggerFactory(sys.stderr)
    else:
        renderer = structlog.dev.ConsoleRenderer()
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=processors(renderer),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level_name]),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )

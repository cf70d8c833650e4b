"""W3C trace context (``traceparent``) carried in every event.

An agent's actions carry the trace of the code that published them (the current
OpenTelemetry span when the optional ``opentelemetry-api`` package is installed, else a
trace of the session handle's own); an observation carries a child span of its action's
trace, so one trace runs agent -> bus -> worker -> memory.  Workers bind ``trace_id`` to
their log lines.  Format: ``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>``.
"""

from __future__ import annotations

import random
import re
from typing import Any

__all__ = ["child_of", "current", "new_trace", "trace_id"]

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def _id(bits: int) -> int:
    """A random id of ``bits`` bits, never 0 (W3C: an all-zero id is invalid).  Ids must be
    unique, not unguessable, so the process's PRNG makes them, as OpenTelemetry's own
    generator does (``secrets`` costs a system call per id, twice per action)."""
    return random.getrandbits(bits) or 1


def new_trace() -> str:
    """A new trace with a new root span, sampled."""
    return f"00-{_id(128):032x}-{_id(64):016x}-01"


def trace_id(traceparent: str | None) -> str | None:
    """The trace id of a well-formed ``traceparent`` (None otherwise)."""
    match = _TRACEPARENT.match(traceparent or "")
    return match.group(1) if match else None


def child_of(traceparent: str | None) -> str | None:
    """A new span in the same trace (None when there is no well-formed parent)."""
    match = _TRACEPARENT.match(traceparent or "")
    if match is None:
        return None
    return f"00-{match.group(1)}-{_id(64):016x}-{match.group(3)}"


def current() -> str | None:
    """The active OpenTelemetry span as a ``traceparent``, when OpenTelemetry is installed and a span is active."""
    trace = _opentelemetry_trace()
    if trace is None:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


_otel_trace: Any = None  # opentelemetry.trace once looked up; False when it is not installed


def _opentelemetry_trace() -> Any:
    """``opentelemetry.trace``, or None; looked up once (a failed import searches sys.path every time)."""
    global _otel_trace
    if _otel_trace is None:
        try:
            from opentelemetry import trace  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415  (optional extra)
        except ImportError:
            _otel_trace = False
        else:
            _otel_trace = trace
    return _otel_trace or None

"""Waiting out an unreachable Redis: call again, backing off, until it answers.

redis-py already retries a command a few times within about a second
(:func:`riverbed.bus.connection.connect_redis`).  A loop that must outlive a longer outage
(a restart, a failover) calls :func:`retry_unavailable`: it repeats the call on
:class:`UnavailableError` with exponential backoff (``first`` doubling up to ``cap`` seconds),
logging each failure, and gives up only once ``stopping`` is set, so a stopping worker is not
held by a Redis that does not come back.  Any other error is the caller's.

A call that is repeated must be safe to repeat: riverbed's writes are (an append's idempotency
key, a claim's value, a lease's fencing token).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import structlog

from riverbed.errors import UnavailableError

__all__ = ["retry_unavailable"]

log = structlog.get_logger("riverbed.bus")

T = TypeVar("T")


async def retry_unavailable(
    call: Callable[[], Awaitable[T]],
    *,
    stopping: anyio.Event | None = None,
    first: float = 0.1,
    cap: float = 2.0,
    what: str = "redis.unavailable",
    **context: Any,
) -> T:
    """``await call()`` until it does not raise :class:`UnavailableError`; that error is
    raised only when it comes while ``stopping`` is set.  Each failure is logged as a warning
    named ``what`` with ``context``, the error and the pause before the next try."""
    pause = first
    while True:
        try:
            return await call()
        except UnavailableError as exc:
            if stopping is not None and stopping.is_set():
                raise
            log.warning(what, error=str(exc), retry_in=pause, **context)
            await anyio.sleep(pause)
            pause = min(pause * 2, cap)

"""Waiting out an unreachable Redis: call again, backing off, until it answers.

redis-py already retries a command a few times within about a second
(:func:`riverbed.bus.connection.connect_redis`).  A loop that must outlive a longer outage
(a restart, a failover) calls :func:`retry_unavailable`: it repeats the call on
:class:`UnavailableError` with exponential backoff (``first`` doubling up to ``cap`` seconds),
logging each failure, and gives up only once ``stopping`` is set, so a stopping worker is not
held by a Redis that does not come back.  Any other error is the caller's.  A loop that
decides for itself what to retry paces its tries with a :class:`Backoff`.

A call that is repeated must be safe to repeat: riverbed's writes are (an append's idempotency
key, a claim's value, a lease's fencing token).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import structlog

from riverbed.errors import UnavailableError

__all__ = ["Backoff", "retry_unavailable"]

log = structlog.get_logger("riverbed.bus")

T = TypeVar("T")


class Backoff:
    """Exponential pauses between tries: ``first``, doubling up to ``cap``; :meth:`reset` after a success."""

    def __init__(self, first: float = 0.1, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self.next = first

    async def pause(self) -> None:
        await anyio.sleep(self.next)
        self.next = min(self.next * 2, self.cap)

    def reset(self) -> None:
        self.next = self.first


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
    backoff = Backoff(first, cap)
    while True:
        try:
            return await call()
        except UnavailableError as exc:
            if stopping is not None and stopping.is_set():
                raise
            log.warning(what, error=str(exc), retry_in=backoff.next, **context)
            await backoff.pause()

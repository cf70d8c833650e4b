"""Waiting out an unreachable Redis: call again, backing off, until it answers.

redis-py already retries a command a few times within about a second
(:func:`riverbed.bus.connection.connect_redis`).  A loop that must outlive a longer outage
(a restart, a failover) calls :func:`retry_unavailable`: it repeats the call on
:class:`UnavailableError` with exponential backoff (``first`` doubling up to ``cap`` seconds),
logging each failure, and gives up only once ``stopping`` is set, so a stopping worker is not
held by a Redis that does not come back.  Any other error is the caller's.  A loop that
decides for itself what to retry paces its tries with a :class:`Backoff`.

Every retry schedule of riverbed is :func:`delay`: exponential from ``first`` up to ``cap``,
with "equal jitter" (each pause is drawn between half and all of its step), so that the
workers a Redis restart failed together do not all come back in the same millisecond.  The
same schedule paces a failing role loop (``bus/failures.py``) and redis-py's own retries of a
command (:class:`RedisBackoff`, in ``bus/connection.py``).

A call that is repeated must be safe to repeat: riverbed's writes are (an append's idempotency
key, a claim's value, a lease's fencing token).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import structlog
from redis.backoff import AbstractBackoff

from riverbed.errors import UnavailableError

__all__ = ["Backoff", "RedisBackoff", "delay", "retry_unavailable"]

log = structlog.get_logger("riverbed.bus")

T = TypeVar("T")


def delay(failures: int, *, first: float = 0.1, cap: float = 2.0) -> float:
    """The pause after ``failures`` failed tries in a row (1 or more): its step is ``first``
    doubled once per earlier failure, at most ``cap``, and the pause is drawn uniformly
    between half the step and the step."""
    step = min(first * 2.0 ** min(max(failures - 1, 0), 62), cap)
    return step / 2 + random.uniform(0, step / 2)


class Backoff:
    """Pauses between tries by :func:`delay`; :meth:`reset` after a success."""

    def __init__(self, first: float = 0.1, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self.failures = 0
        self.next = delay(1, first=first, cap=cap)

    async def pause(self) -> None:
        await anyio.sleep(self.next)
        self.failures += 1
        self.next = delay(self.failures + 1, first=self.first, cap=self.cap)

    def reset(self) -> None:
        self.failures = 0
        self.next = delay(1, first=self.first, cap=self.cap)


class RedisBackoff(AbstractBackoff):
    """:func:`delay` as redis-py's retry policy wants it (``compute`` takes the failures so far)."""

    def __init__(self, first: float, cap: float) -> None:
        self.first = first
        self.cap = cap

    def reset(self) -> None:
        pass  # the schedule is a function of the failures redis-py counts

    def compute(self, failures: int) -> float:
        return delay(failures, first=self.first, cap=self.cap)


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

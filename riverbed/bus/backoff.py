"""Waiting out an unreachable Redis: call again, backing off, until it answers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import structlog

from riverbed.errors import UnavailableError

__all__ = ["Backoff", "until_answered"]

log = structlog.get_logger("riverbed.worker")
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


async def until_answered(fn: Callable[[], Awaitable[T]], stopping: anyio.Event) -> T:
    """Call ``fn`` until Redis answers (backing off from 0.1 to 2 s), unless ``stopping`` is set:
    then the :class:`UnavailableError` is raised."""
    backoff = Backoff()
    while True:
        try:
            return await fn()
        except UnavailableError as exc:
            if stopping.is_set():
                raise
            log.warning("redis.unavailable", error=str(exc), retry_in=backoff.next)
            await backoff.pause()

"""The model's shared limits: calls in flight and calls a minute, per model, for all agent workers.

::

    throttle = Throttle(redis, keys, max_in_flight=4, per_minute=60)
    async with throttle.permit("gpt-4o-mini", tenant, ticket) as permit:  # or Saturated
        async with anyio.create_task_group() as tg:
            tg.start_soon(permit.keep)   # renews the permit's lease while the call runs
            ...the model call...

A provider's rate limit is everyone's: with one counter per worker, N workers make N times
the calls the provider allows, and each run in flight meets a 429.  So a model's limits live
in Redis (``keys.model_limit``), taken and given back by scripts (``bus/scripts.py``,
``MODEL_PERMIT``): at most ``RIVERBED_LLM_MAX_CONCURRENCY`` calls to a model in flight, and at
most ``RIVERBED_LLM_RPM`` started in any minute (0: no limit; with both 0, nothing is asked of
Redis).  A permit is a lease: a worker renews it while its call runs, and a dead worker's
permits come back when their lease ends (:data:`LEASE_SECONDS`).

A call that finds no room does not fail: :meth:`Throttle.permit` raises
:class:`~riverbed.agent.retry.Saturated` with how long to wait, and the retry policy waits
that long and asks again, within its budget (``agent/retry.py``).  While it waits the call
holds its tenant's *turn*: a permit that frees goes to the tenant whose turn comes first, and
a tenant served goes to the back, so a tenant with a hundred runs waiting does not starve
another's one.  A server's ``Retry-After`` on a 429 or 503 pauses the model for every worker
(:meth:`Throttle.pause`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
import structlog

from riverbed.agent.retry import Saturated
from riverbed.bus import scripts
from riverbed.bus.keys import Keys
from riverbed.bus.redis_client import RedisClient

__all__ = ["LEASE_SECONDS", "Permit", "Throttle"]

log = structlog.get_logger("riverbed.agent")

T = TypeVar("T")

LEASE_SECONDS = 15.0
"""How long a permit is held without renewal (a dead worker's permit comes back after it)."""
WAITER_SECONDS = 3.0
"""How long a call that asked for a permit keeps its tenant's turn without asking again."""

_HELD, _WINDOW, _TURNS, _WAITING, _OWNERS, _COUNTS, _PAUSED, _SEQ = (
    "held", "window", "turns", "waiting", "owners", "counts", "paused", "seq",
)  # fmt: skip


@dataclass
class Permit:
    """A permit held (or, with no limits, nothing to hold)."""

    throttle: Throttle | None
    model: str
    ticket: str

    async def keep(self) -> None:
        """Renew the permit's lease until cancelled (start it beside the call it covers)."""
        if self.throttle is None:
            return
        while True:
            await anyio.sleep(self.throttle.lease / 3)
            if not await self.throttle.renew(self.model, self.ticket):
                log.warning("throttle.permit_lost", model=self.model, ticket=self.ticket)
                return


class Throttle:
    """A model's calls in flight and calls a minute, shared through Redis (see the module)."""

    def __init__(
        self,
        redis: RedisClient,
        keys: Keys,
        *,
        max_in_flight: int = 0,
        per_minute: int = 0,
        lease: float = LEASE_SECONDS,
    ) -> None:
        self.redis = redis
        self.lease = lease
        self.keys = keys
        self.max_in_flight = max_in_flight
        self.per_minute = per_minute
        self._permit = redis.script(scripts.MODEL_PERMIT)
        self._leave = redis.script(scripts.MODEL_LEAVE)
        self._renew = redis.script(scripts.MODEL_RENEW)
        self._pause = redis.script(scripts.MODEL_PAUSE)

    @property
    def limited(self) -> bool:
        return self.max_in_flight > 0 or self.per_minute > 0

    def _key(self, model: str, part: str) -> str:
        return self.keys.model_limit(model, part)

    @contextlib.asynccontextmanager
    async def permit(self, model: str, tenant: str | None, ticket: str) -> AsyncIterator[Permit]:
        """Hold one of ``model``'s permits for the block; :class:`Saturated` when there is none
        for ``tenant`` now.  ``ticket`` names the call, the same on each of its tries (it keeps
        its tenant's turn between them)."""
        if not self.limited:
            yield Permit(None, model, ticket)
            return
        granted, wait_ms, why = await self.try_take(model, tenant or "", ticket)
        if not granted:
            raise Saturated(self._sentence(model, why), wait_ms / 1000)
        try:
            yield Permit(self, model, ticket)
        finally:
            with anyio.CancelScope(shield=True):
                await self.leave(model, ticket)

    async def run(self, model: str, tenant: str | None, ticket: str, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()`` holding one of ``model``'s permits, renewed while it runs;
        :class:`Saturated` (before the call) when there is none for ``tenant`` now."""
        async with self.permit(model, tenant, ticket) as permit:
            if permit.throttle is None:
                return await call()
            outcome: list[T] = []
            failure: list[Exception] = []
            async with anyio.create_task_group() as tg:

                async def work() -> None:
                    try:
                        outcome.append(await call())
                    except Exception as exc:  # (raised below as it is, not in a group)
                        failure.append(exc)
                    finally:
                        tg.cancel_scope.cancel()

                tg.start_soon(work)
                tg.start_soon(permit.keep)
            if failure:
                raise failure[0]
            return outcome[0]

    async def try_take(self, model: str, tenant: str, ticket: str) -> tuple[bool, int, str]:
        """One try for a permit, held until :meth:`leave` (not renewed): whether it was granted,
        else the milliseconds to wait and why (``paused``, ``concurrency``, ``rate``, ``turn``)."""
        keys = [self._key(model, part) for part in (_HELD, _WINDOW, _TURNS, _WAITING, _OWNERS, _COUNTS, _PAUSED, _SEQ)]
        lease_ms, ttl_ms = int(self.lease * 1000), int(WAITER_SECONDS * 1000)
        reply = await self._permit(keys, [ticket, tenant, self.max_in_flight, self.per_minute, lease_ms, ttl_ms])
        why = reply[2].decode() if isinstance(reply[2], bytes) else str(reply[2])
        return bool(int(reply[0])), int(reply[1]), why

    async def leave(self, model: str, ticket: str) -> None:
        """Give the ticket's permit back, or stop waiting for one."""
        keys = [self._key(model, part) for part in (_HELD, _WAITING, _OWNERS, _COUNTS, _TURNS)]
        await self._leave(keys, [ticket])

    async def renew(self, model: str, ticket: str) -> bool:
        """Hold the ticket's permit for another lease; False when it was lost meanwhile."""
        return bool(int(await self._renew([self._key(model, _HELD)], [ticket, int(self.lease * 1000)])))

    async def pause(self, model: str, seconds: float) -> None:
        """Grant no permit of ``model`` for ``seconds`` (the server asked every caller to wait)."""
        if not self.limited or seconds <= 0:
            return
        await self._pause([self._key(model, _PAUSED)], [max(1, math.ceil(seconds * 1000))])

    def _sentence(self, model: str, why: str) -> str:
        if why == "paused":
            return f"the model server asked callers of {model!r} to wait (Retry-After)"
        if why == "rate":
            return f"{model!r} had its {self.per_minute} calls in the last minute (RIVERBED_LLM_RPM)"
        if why == "turn":
            return f"{model!r} serves other tenants' calls first (their turn came before)"
        return f"{model!r} has {self.max_in_flight} calls in flight (RIVERBED_LLM_MAX_CONCURRENCY)"

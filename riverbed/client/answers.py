"""A client's waits for answers, many on a few connections.

An act normally sends its append and a blocking ``XREAD`` for the answer in one write, and
waits on that connection: one round trip, and the connection is the act's until the answer
comes.  That is the fastest way, and a client opens connections as its acts need them.  But a
client with thousands of acts in flight would hold thousands of connections (and fail past
its pool's bound).  So from :data:`MOST` connections in use, an act that finds none free is
*crowded*:

- its append goes out in a batch: every command queued in one turn of the event loop is
  written in one send on one pooled connection (:meth:`Answers.call`);
- it waits on the session's wake-up channel (the append script publishes the log's new last
  id there, ``bus/wakeups.py``): one subscribed connection per Redis node for the whole client;
- when a wake-up says the log moved past what it has read, it reads (non-blocking, batched).

The same waiting serves an act whose answer did not come within its first blocking read, so a
long command holds no connection either.  Pub/Sub delivers at most once: a feed that
reconnects rings every bell, and a wait that hears nothing reads once a second anyway.

Only on a standalone Redis: on a cluster every act waits on a connection of its node's pool.
The background work (the feeds, the batches) runs in one task of the client's own, started
by :func:`riverbed.connect` and ended by :meth:`Answers.aclose`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import redis.asyncio as aioredis
import redis.exceptions as rexc
import structlog
from anyio.abc import TaskGroup

from riverbed.bus.connection import RawClient, Turn, translate
from riverbed.bus.exchange import exchange
from riverbed.bus.keys import Keys
from riverbed.bus.wakeups import Bell, Wakeups
from riverbed.errors import UnavailableError

__all__ = ["Answers"]

log = structlog.get_logger("riverbed.client")

#: Connections in use from which an act that finds none free is crowded rather than open one.
MOST = 1024
#: Batches on the wire at once (each on a pooled connection of its own).
BATCHES = 4
#: Sessions whose wake-up channel stays subscribed while none of their acts is in flight.
KEPT = 10_000
#: The bell role of a client's waits (the append script never tells a client to skip one).
ROLE = "client"


class _Call:
    __slots__ = ("command", "done", "error", "reply")

    def __init__(self, command: Sequence[Any]) -> None:
        self.command = command
        self.done = anyio.Event()
        self.reply: Any = None
        self.error: BaseException | None = None

    def settle(self, reply: Any = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.reply, self.error = reply, error
            self.done.set()


class _Watch:
    __slots__ = ("bell", "waiting")

    def __init__(self, bell: Bell) -> None:
        self.bell = bell
        self.waiting = 0


class Answers:
    """Batched commands and wake-up bells for one client (:mod:`riverbed.client.answers`)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, url: str, *, most: int = MOST) -> None:
        self.redis = redis
        self._pool: Any = redis.connection_pool
        self.url = url
        self.most = most
        self.wakeups = Wakeups(redis, keys)
        self._turns = anyio.CapacityLimiter(BATCHES)
        self._queue: list[_Call] = []
        self._watches: OrderedDict[str, _Watch] = OrderedDict()
        self._tg: TaskGroup | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, redis: RawClient, keys: Keys, url: str) -> Answers | None:
        """Answers for ``redis`` with its background task running; None on a cluster."""
        if not isinstance(redis, aioredis.Redis) or not hasattr(redis.connection_pool, "spare"):
            return None
        answers = cls(redis, keys, url)
        started = anyio.Event()
        # A task of its own rather than a task group around the caller's block: the client is
        # often entered through an exit stack, inside cancel scopes it must not nest under.
        answers._task = asyncio.get_running_loop().create_task(answers._run(started))
        await started.wait()
        return answers if answers.running else None

    async def _run(self, started: anyio.Event) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await tg.start(self.wakeups.run)
                started.set()
        except Exception:  # acts go back to a connection each
            log.exception("answers.stopped")
        finally:
            self._tg = None
            self._fail(UnavailableError("the client is closed"))
            started.set()

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def crowded(self) -> bool:
        """Whether an act now would find no free connection with :attr:`most` in use (then
        it waits here instead of opening one more)."""
        return self._tg is not None and not self._pool.spare(self.most)

    @property
    def running(self) -> bool:
        return self._tg is not None

    # --- batches ----------------------------------------------------------------------------

    async def call(self, command: Sequence[Any]) -> Any:
        """``command``'s raw reply, sent with every other command queued in the same turn of the
        event loop in one write; an error reply raises it as every riverbed call does
        (:func:`~riverbed.bus.connection.translate`: ``rexc.ResponseError`` unless it is riverbed's
        to name), a lost connection :class:`UnavailableError`."""
        call = _Call(command)
        self._queue.append(call)
        if len(self._queue) == 1:
            if self._tg is None:
                self._queue.clear()
                raise UnavailableError("the client is closed")
            self._tg.start_soon(self._flush)
        await call.done.wait()
        if call.error is not None:
            with translate(self.url):
                raise call.error
        return call.reply

    async def _flush(self) -> None:
        async with Turn(self._turns):
            batch, self._queue = self._queue, []
            try:
                async with exchange(self.redis, *(c.command for c in batch), url=self.url) as replies:
                    assert replies is not None  # a standalone client (start)
                    for call in batch:
                        try:
                            call.settle(await replies.read())
                        except rexc.ResponseError as exc:
                            call.settle(error=exc)
            except Exception as exc:  # (translated: UnavailableError) every call of the batch hears it
                for call in batch:
                    call.settle(error=exc)
            finally:
                for call in batch:  # cancelled: the client is closing
                    call.settle(error=UnavailableError("the client is closed"))

    def _fail(self, error: BaseException) -> None:
        queue, self._queue = self._queue, []
        for call in queue:
            call.settle(error=error)

    # --- bells ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watch(self, session: str) -> AsyncIterator[Bell]:
        """The bell of ``session``'s wake-ups, subscribed (and confirmed, or a second passed)
        for the block.  The channel stays subscribed afterwards for the :data:`KEPT` sessions
        used last, so a session's next act subscribes nothing."""
        watch = self._watches.get(session)
        if watch is None:
            bell = await self.wakeups.watch(session, ROLE)
            watch = self._watches.get(session)
            if watch is None:
                watch = self._watches[session] = _Watch(bell)
            else:  # another act of the session subscribed it meanwhile: one bell a session
                await self.wakeups.unwatch(session, bell)
        else:
            self._watches.move_to_end(session)
        watch.waiting += 1
        try:
            yield watch.bell
        finally:
            watch.waiting -= 1
            if len(self._watches) > KEPT:
                await self._forget()

    async def _forget(self) -> None:
        """Unsubscribe the least recently used sessions with nobody waiting, down to :data:`KEPT`."""
        idle = [s for s, w in self._watches.items() if not w.waiting][: len(self._watches) - KEPT]
        for session in idle:
            watch = self._watches.pop(session)
            await self.wakeups.unwatch(session, watch.bell)

"""The consumer loop of one role in one worker: take sessions, serve them, survive crashes.

An :class:`Owner` wires three rooms together and keeps what they share (the sessions it owns,
its counters, its failures, whether it is stopping):

- **leasing** (``bus/leasing.py``): intake, reclaim and renew;
- **the session loop** (``bus/session_loop.py``): one per owned session; it reads when the
  session's wake-up rings (``bus/wakeups.py``) and sends a held answer with its next read;
- **dispatch** (``bus/dispatch.py``): hands batches to the role's :class:`Handler`, backs off
  when a service is down, dead-letters entries that keep failing.

No session holds a connection of its own: the loops read without blocking on the worker's
shared, bounded connection pool, and one subscribed connection per Redis node wakes them.

Failures inside a handler never escape: an entry that keeps failing (or that crashed its
worker) ``max_attempts`` times goes to the dead-letter stream, the session gets an
``error`` event, and the loop goes on.  :class:`UnavailableError` (Postgres or the embedder
down) is not the entry's fault: the loop backs off and retries without counting attempts;
an answer whose append failed that way is appended again (never the action run again).

Shutdown is two-phase: :meth:`Owner.drain` stops intake and lets each session loop finish
its current batch; after the drain deadline the rest is cancelled; releases run shielded
and re-announce each session so a peer takes it at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from riverbed.bus.backoff import retry_unavailable
from riverbed.bus.claims import Claims
from riverbed.bus.connection import RawClient
from riverbed.bus.dispatch import Dispatcher
from riverbed.bus.dlq import DeadLetters
from riverbed.bus.failures import Failures
from riverbed.bus.grouped import Batched, GroupedAnswers, GroupedPending, GroupedReads
from riverbed.bus.handling import Answer, Entry, Handler, OwnerStats, SessionContext
from riverbed.bus.keys import Keys
from riverbed.bus.leasing import Leasing
from riverbed.bus.log import Log
from riverbed.bus.ownership import Leases
from riverbed.bus.redis_client import RedisClient, as_client
from riverbed.bus.session_loop import READ_COUNT, SessionLoop
from riverbed.bus.wakeups import Wakeups
from riverbed.errors import UnavailableError

__all__ = ["Answer", "Entry", "Handler", "HotReads", "Owned", "Owner", "OwnerStats", "SessionContext"]

log = structlog.get_logger("riverbed.worker")


@dataclass
class HotReads:
    """A few connections of a worker's on which busy sessions wait for their next entry
    (``bus/session_loop.py``); ``slots`` bounds how many wait at once (one connection each)."""

    client: RedisClient
    slots: anyio.CapacityLimiter


@dataclass
class Owned:
    """A session this owner holds: its directory entry, fencing token and loop's cancel scope."""

    entry: str
    token: int
    scope: anyio.CancelScope
    lost: bool = False
    """Its lease renewal failed (another owner holds it now): the loop was cancelled for it."""
    meta: tuple[str | None, str] | None = None
    """The session's tenant and creation stamp as the acquire read them (None: not read)."""


class Owner:
    """Serves one role for up to ``capacity`` sessions at a time."""

    def __init__(
        self,
        redis: RawClient,
        keys: Keys,
        handler: Handler,
        *,
        worker: str,
        capacity: int = 100,
        lease_seconds: float = 5.0,
        park_after: float = 60.0,
        max_attempts: int = 3,
        url: str = "redis",
        wakeups: Wakeups | None = None,
        hot: HotReads | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.handler = handler
        self.role = handler.role
        self.worker = worker
        self.capacity = capacity
        self.lease_seconds = lease_seconds
        self.park_after = park_after
        self.max_attempts = max_attempts
        self.url = url
        self.client = as_client(redis, url)
        """The typed adapter every command goes through (``redis`` stays the redis-py client the
        wake-up feeds open their connections from)."""
        self.batch = Batched(self.client)
        """The commands of taking a session, sent together for the sessions taken at once."""
        self.log = Log(self.client, keys, url, batch=self.batch)
        lease_ms = math.ceil(lease_seconds * 1000)
        self.leases = Leases(self.client, keys, self.role, worker=worker, lease_ms=lease_ms, url=url, batch=self.batch)
        self.dlq = DeadLetters(self.client, keys, url)
        self.claims = Claims(self.client, keys, worker=worker, lease_seconds=lease_seconds, url=url)
        self.owned: dict[str, Owned] = {}
        self.stats = OwnerStats()
        self.failures = Failures()
        """The role loops failing right now (shown by ``/readyz`` and ``riverbed status``)."""
        self.ready = False
        self.stopping = anyio.Event()
        self._own_wakeups = wakeups is None
        self.wakeups = wakeups if wakeups is not None else Wakeups(redis, keys)
        """Shared by the worker's roles; an owner made alone runs its own."""
        self.hot = hot
        """Without it every read is a non-blocking one after a wake-up."""
        self.reads = GroupedReads(self.client, self.role, worker, READ_COUNT)
        self.answers = GroupedAnswers(self.client)
        self.pending = GroupedPending(self.client, self.role)
        """The sessions' reads without waiting, answers sent on their own and checks for stray
        entries go together when their loops ask together (``bus/grouped.py``)."""
        self.dispatcher = Dispatcher(self)
        self.leasing = Leasing(self)
        self._changed = anyio.Event()
        self._drained = anyio.Event()
        self._tg: TaskGroup | None = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await retry_unavailable(self.leases.ensure_group, stopping=self.stopping)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if self._own_wakeups:
                await tg.start(self.wakeups.run)
            tg.start_soon(self.leasing.intake)
            tg.start_soon(self.leasing.reclaim)
            tg.start_soon(self.leasing.renew)
            self.ready = True
            task_status.started()
            await self._drained.wait()
            tg.cancel_scope.cancel()

    async def drain(self, deadline: float) -> None:
        """Stop taking sessions; let in-flight work finish for up to ``deadline`` seconds, then
        cancel what is left.  Every session is released (and re-announced) before this returns."""
        self.stopping.set()
        # Each loop ends by itself once its batch is done (woken now, not at its next check):
        # a loop cancelled in the middle of a command can leave redis-py's connection half read.
        self.wakeups.ring_all()
        await self.wait_for(lambda: not self.owned, deadline)
        for owned in list(self.owned.values()):
            owned.scope.cancel()
        await self.wait_for(lambda: not self.owned, max(1.0, deadline))
        self._drained.set()

    def start_session(self, session: str, entry: str, token: int, meta: tuple[str | None, str] | None = None) -> None:
        """Serve ``session``, just acquired with ``token``, in a loop of its own (``meta``: its
        tenant and creation stamp, when the acquire read them)."""
        owned = self.owned[session] = Owned(entry=entry, token=token, scope=anyio.CancelScope(), meta=meta)
        assert self._tg is not None
        self._tg.start_soon(SessionLoop(self, session, owned).serve)

    async def finish(self, loop: SessionLoop, parked: bool) -> None:
        """A session loop ended: close the handler's session, forget it, release its lease
        (unless it was parked, which released it already)."""
        try:
            await self.handler.close(loop.ctx)
        except Exception:
            log.exception("handler.close_failed", role=self.role, session=loop.session)
        if self.owned.get(loop.session) is loop.owned:
            del self.owned[loop.session]
        if not parked:
            try:
                await self.leases.release(loop.session, loop.owned.entry, loop.owned.token)
            except UnavailableError as exc:
                log.warning("release.unavailable", role=self.role, session=loop.session, error=str(exc))
            except Exception:
                # Never the owner's end: the lease runs out and a peer reclaims the session.
                log.exception("release.failed", role=self.role, session=loop.session)
        self.leasing.slot_freed.set()
        self.changed()

    def changed(self) -> None:
        """The owned sessions changed: wake :meth:`wait_for`."""
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, done: Callable[[], bool], timeout: float) -> None:
        """Wait until ``done()`` (about the owned sessions) holds, for at most ``timeout`` seconds."""
        with anyio.move_on_after(timeout):
            while not done():
                await self._changed.wait()

"""The consumer loop of one role in one worker: take sessions, serve them, survive crashes.

An :class:`Owner` wires three rooms together.  It hands each one what it uses, never itself
(``bus/handles.py``): the frozen :class:`Handles` (client, keys, log, leases, claims, dead
letters...), the :class:`OwnerState` they share (the sessions it owns, its counters, its
failures, whether it is stopping), and plain callables where a room tells the owner something
(a session was acquired, a session loop ended):

- **the lease loops** (``bus/lease_loops.py``): intake, reclaim and renew;
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

from typing import TYPE_CHECKING

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from riverbed.bus.backoff import retry_unavailable
from riverbed.bus.connection import RawClient
from riverbed.bus.dispatch import Dispatcher
from riverbed.bus.handles import Handles, HotReads, Masks, Owned, OwnerState, OwnerStats
from riverbed.bus.handling import Answer, Entry, Handler, SessionContext
from riverbed.bus.keys import Keys
from riverbed.bus.lease_loops import LeaseLoops
from riverbed.bus.session_loop import SessionLoop
from riverbed.bus.wakeups import Wakeups
from riverbed.errors import UnavailableError

if TYPE_CHECKING:
    from riverbed.bus.action_claims import Claims
    from riverbed.bus.dlq import DeadLetters
    from riverbed.bus.failures import Failures
    from riverbed.bus.grouped import Batched
    from riverbed.bus.leases import Leases
    from riverbed.bus.log import Log
    from riverbed.bus.redis_client import RedisClient

__all__ = [
    "Answer",
    "Entry",
    "Handler",
    "Handles",
    "HotReads",
    "Owned",
    "Owner",
    "OwnerState",
    "OwnerStats",
    "SessionContext",
]

log = structlog.get_logger("riverbed.worker")


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
        tenant_share: float = 1.0,
        lease_seconds: float = 5.0,
        park_after: float = 60.0,
        max_attempts: int = 3,
        url: str = "redis",
        wakeups: Wakeups | None = None,
        hot: HotReads | None = None,
        masks: Masks | None = None,
    ) -> None:
        self.redis = redis
        """The redis-py client the wake-up feeds open their connections from."""
        self.handler = handler
        self.capacity = capacity
        self._own_wakeups = wakeups is None
        self.handles = Handles.open(
            redis,
            keys,
            handler.role,
            worker=worker,
            wakeups=wakeups if wakeups is not None else Wakeups(redis, keys),
            lease_seconds=lease_seconds,
            park_after=park_after,
            max_attempts=max_attempts,
            url=url,
            hot=hot,
            masks=masks,
        )
        """What the rooms talk to Redis through (the wake-ups are shared by the worker's roles;
        an owner made alone runs its own)."""
        self.state = OwnerState()
        """What the rooms share: the sessions owned, the counters, the failures, the stop signal."""
        self.ready = False
        self.dispatcher = Dispatcher(self.handles, handler, stats=self.state.stats, stopping=self.state.stopping)
        self.lease_loops = LeaseLoops(
            self.handles,
            self.state,
            capacity=capacity,
            start_session=self.start_session,
            room=getattr(handler, "room", None),
            serves=getattr(handler, "serves", None),
            tenant_share=tenant_share,
        )
        self._drained = anyio.Event()
        self._tg: TaskGroup | None = None

    # What the worker, its metrics and the tests read of an owner.
    @property
    def role(self) -> str:
        return self.handles.role

    @property
    def worker(self) -> str:
        return self.handles.worker

    @property
    def keys(self) -> Keys:
        return self.handles.keys

    @property
    def client(self) -> RedisClient:
        return self.handles.client

    @property
    def log(self) -> Log:
        return self.handles.log

    @property
    def leases(self) -> Leases:
        return self.handles.leases

    @property
    def claims(self) -> Claims:
        return self.handles.claims

    @property
    def dlq(self) -> DeadLetters:
        return self.handles.dlq

    @property
    def batch(self) -> Batched:
        return self.handles.batch

    @property
    def wakeups(self) -> Wakeups:
        return self.handles.wakeups

    @property
    def lease_seconds(self) -> float:
        return self.handles.lease_seconds

    @property
    def owned(self) -> dict[str, Owned]:
        return self.state.owned

    @property
    def stats(self) -> OwnerStats:
        return self.state.stats

    @property
    def failures(self) -> Failures:
        """The role loops failing right now (shown by ``/readyz`` and ``riverbed status``)."""
        return self.state.failures

    @property
    def stopping(self) -> anyio.Event:
        return self.state.stopping

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await retry_unavailable(self.handles.leases.ensure_group, stopping=self.state.stopping)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if self._own_wakeups:
                await tg.start(self.handles.wakeups.run)
            tg.start_soon(self.lease_loops.intake)
            tg.start_soon(self.lease_loops.reclaim)
            tg.start_soon(self.lease_loops.renew)
            self.ready = True
            task_status.started()
            await self._drained.wait()
            tg.cancel_scope.cancel()

    async def drain(self, deadline: float) -> None:
        """Stop taking sessions; let in-flight work finish for up to ``deadline`` seconds, then
        cancel what is left.  Every session is released (and re-announced) before this returns."""
        state = self.state
        state.stopping.set()
        # Each loop ends by itself once its batch is done (woken now, not at its next check):
        # a loop cancelled in the middle of a command can leave redis-py's connection half read.
        self.handles.wakeups.ring_all()
        await state.wait_for(lambda: not state.owned, deadline)
        for owned in list(state.owned.values()):
            owned.scope.cancel()
        await state.wait_for(lambda: not state.owned, max(1.0, deadline))
        self._drained.set()

    def start_session(
        self,
        session: str,
        entry: str,
        token: int,
        meta: tuple[str | None, str] | None,
        acquired: float,
        reclaimed: bool,
    ) -> None:
        """Serve ``session``, just acquired with ``token``, in a loop of its own (``meta``: its
        tenant and creation stamp, when the acquire read them; ``acquired``: when the acquire
        was sent, ``time.monotonic()``: it set the lease, which holds for a lease from then, as
        after a renewal, so the session's first model calls need not ask Redis whether it does;
        ``reclaimed``: taken over from an owner that may still read its log for a while)."""
        owned = Owned(entry=entry, token=token, scope=anyio.CancelScope(), meta=meta, renewed=acquired)
        self.state.own(session, owned)
        assert self._tg is not None
        loop = SessionLoop(
            self.handles,
            self.state,
            self.handler,
            session,
            owned,
            dispatch=self.dispatcher.dispatch,
            finish=self.finish,
            taken_over=reclaimed,
        )
        self._tg.start_soon(loop.serve)

    async def finish(self, loop: SessionLoop, parked: bool) -> None:
        """A session loop ended: close the handler's session, forget it, release its lease
        (unless it was parked, which released it already)."""
        role = self.handles.role
        try:
            await self.handler.close(loop.ctx)
        except Exception:
            log.exception("handler.close_failed", role=role, session=loop.session)
        self.state.disown(loop.session, loop.owned)
        if not parked:
            try:
                await self.handles.leases.release(
                    loop.session, loop.owned.entry, loop.owned.token, tenant=loop.owned.tenant
                )
            except UnavailableError as exc:
                log.warning("release.unavailable", role=role, session=loop.session, error=str(exc))
            except Exception:
                # Never the owner's end: the lease runs out and a peer reclaims the session.
                log.exception("release.failed", role=role, session=loop.session)
        self.lease_loops.slot_freed.set()
        self.state.changed()

"""The loop serving one owned session: read, recover strays, park, send what it holds with the next read.

It creates the role's consumer group on the log, watches the session's wake-ups
(``bus/wakeups.py``), hands entries that were in flight on the previous owner to the handler's
``recover``, then reads new entries (``XREADGROUP >`` without ``BLOCK``, on the worker's shared
connection pool) whenever the session's bell rings, and at least every few seconds.  Then it
also recovers entries left pending with nobody working on them (a delivery whose reply was
lost with a broken connection, or one that a stale owner read after the takeover).  An answer
the handler returned (:class:`~riverbed.bus.handling.Answer`) goes out in one write with the
next read (``bus/exchange.py``), and so do the writes the handler held for it
(``SessionContext.ack_with_read``: the agent role's acknowledgements and run summaries);
anything else the loop does first sends them on their own.

A session idle for ``park_after`` is parked: released without an owner until its next append
announces it again.  One whose handler says it ``retires`` (the agent role, once the run ended)
is released when idle, and announced to that role again only by an append that asks for it.

When the log's group is gone, or the log delivers ids at or before the
last one this loop handled (the log started over), the loop checks its lease and ends if it
was lost with Redis's data, never re-creating a group that would hand a stale owner the new
log's actions.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
import redis.exceptions as rexc
import structlog

from riverbed.bus.backoff import Backoff
from riverbed.bus.connection import group_lost
from riverbed.bus.exchange import stream_entries, written
from riverbed.bus.faults import crashpoint
from riverbed.bus.handles import READ_COUNT, Handles, Owned, OwnerState
from riverbed.bus.handling import Answer, Entry, Handler, SessionContext
from riverbed.bus.log import entry_id
from riverbed.bus.redis_client import RedisClient, StreamEntry
from riverbed.bus.wakeups import Bell
from riverbed.errors import FencedError, UnavailableError

__all__ = [
    "MAX_STRAY_CHECK_SECONDS",
    "READ_COUNT",
    "STRAY_CHECK_SECONDS",
    "Dispatch",
    "Finish",
    "SessionLoop",
    "group_lost",
]

log = structlog.get_logger("riverbed.worker")

#: How long a session whose handler ``leaves`` it is held before it is announced again: a worker
#: that hosts none of what the session needs takes it at most this often.
LEAVE_AFTER = 2.0
#: How long a read by a session that just had work waits for the next entry, on one of the
#: worker's few hot connections (``HotReads``): a busy session's next action is delivered as
#: it is appended, with no wake-up and no second read in between.
HOT_BLOCK_MS = 250
#: How often an owned session looks for entries pending with nobody working on them, and reads
#: once even when its bell did not ring (a wake-up lost, though a feed that reconnects rings every
#: bell it serves): a second after the session is taken over or a stray was found, or when its
#: wake-ups' subscription was not confirmed yet when its loop began, at once after a failed read,
#: then twice as long after each check that found none, up to the maximum, busy or idle.  A
#: session taken from the directory (its last owner let it go, or it had none) is first checked
#: after the maximum: what was pending when it was taken was handled then (``in_flight``), and no
#: other owner reads it since.  A stray comes of a takeover (a stale owner's read, in the seconds
#: after it lost the lease) or of a lost reply (a failed read, checked at once), not of the
#: session's own work, so a busy session is checked no more often than an idle one (each action
#: would cost one).  Each check costs the worker about 0.1 ms: at 1, 2, 4 and then 8 s apart they
#: were half of what a runtime worker spent on the sessions it held idle (``docs/benchmarks.md``).
STRAY_CHECK_SECONDS = 1.0
MAX_STRAY_CHECK_SECONDS = 30.0


class Dispatch(Protocol):
    """Hands a batch to the role's handler (``bus/dispatch.py``); the answer it left to send."""

    async def __call__(self, ctx: SessionContext, batch: list[Entry], *, recovering: bool) -> Answer | None: ...


#: Told by a loop that it ended (``parked``: its lease was released already).
Finish = Callable[["SessionLoop", bool], Awaitable[None]]


class SessionLoop:
    """Serves one session for one owner until it is released, parked, lost or fenced.

    It is handed the owner's :class:`~riverbed.bus.handles.Handles` and shared state, the role's
    handler, and two callables: ``dispatch`` runs a batch through the handler, ``finish`` is
    told when the loop ends.
    """

    def __init__(
        self,
        handles: Handles,
        state: OwnerState,
        handler: Handler,
        session: str,
        owned: Owned,
        *,
        dispatch: Dispatch,
        finish: Finish,
        taken_over: bool = True,
    ) -> None:
        """``taken_over``: the session was reclaimed from an owner that stopped renewing (or
        this worker held it before a restart): its first stray checks come soon."""
        self.handles = handles
        self.state = state
        self.handler = handler
        self.dispatch = dispatch
        self.finish = finish
        self.taken_over = taken_over
        self.session = session
        self.owned = owned
        self.ctx = SessionContext(
            handles,
            session,
            owned.token,
            owned.meta,
            stopping=state.stopping,
            stats=state.stats,
            ignores_own_answers=handler.ignores_own_answers,
            owned=owned,
        )
        self.held: Answer | None = None
        self.hot = False
        """The last read delivered entries: the next one may wait for more on a hot connection."""
        self.strays_now = False
        """A read's reply may have been lost (entries delivered to nobody working on them): look
        for strays at once."""
        self.mark = 0
        """The bell's count when the last read was sent: a ring since means the log may have moved."""
        self.log = log.bind(role=handles.role, session=session, worker=handles.worker)
        self.bell = Bell(handles.role)
        """The session's wake-up bell (a placeholder until :meth:`serve` watches the session)."""
        self.retires: Callable[[SessionContext], bool] | None = getattr(handler, "retires", None)
        """The handler's "nothing more to do here until the role is asked for again" (the agent
        role's, once a run ended): the idle session is then retired, not parked."""
        self.on_demand: bool = getattr(handler, "on_demand", False)
        """The role is announced only by appends of its own work (the runtime role: an action it
        runs): an idle session is retired, so that other appends do not announce it again."""
        self.wake_at: Callable[[SessionContext], float | None] | None = getattr(handler, "wake_at", None)
        """The handler's next deadline (``time.monotonic()``) for the session, when it has one
        (the agent role's: an action that may go unanswered for only so long): at that time the
        loop calls its ``tick``, and it does not park the session before."""
        self.leaves: Callable[[SessionContext], bool] | None = getattr(handler, "leaves", None)
        """The handler's "this session is another worker's to serve" (the agent role's, for a run
        whose agent definition it does not host): held :data:`LEAVE_AFTER`, then released and
        announced again, for a worker that matches."""

    async def serve(self) -> None:
        handles, ctx = self.handles, self.ctx
        parked = False
        bell: Bell | None = None
        try:
            with self.owned.scope:
                await self.ensure_group()
                await self.handler.open(ctx)
                bell = await handles.wakeups.watch(self.session, handles.role)
                heard = handles.wakeups.confirmed_for(self.session)
                in_flight = await self.in_flight()
                if in_flight:
                    self.log.info("session.recover", entries=len(in_flight))
                    self.held = await self.dispatch(ctx, in_flight, recovering=True)
                self.bell = bell
                parked = await self._loop(bell, soon=self.taken_over or not heard)
            if self.owned.lost:
                self.log.warning("session.fenced", found="its lease renewal failed")
        except FencedError:
            self.log.warning("session.fenced")
        except Exception:
            # A bug or a broken session must not take the worker down: give the session back
            # after a pause (so a persistent failure does not spin) and go on with the others.
            self.log.exception("session.failed")
            await anyio.sleep(1.0)
        finally:
            with anyio.CancelScope(shield=True):
                await self._send_held_answer()
                if bell is not None:
                    await handles.wakeups.unwatch(self.session, bell)
                await self.finish(self, parked)

    async def _give_back(self, **how: Any) -> int:
        """Release the session's lease (``how``: :meth:`Leases.release`'s options); its answer.
        While the release is on its way, a renewal that finds the lease gone (Redis ran the
        release first) reports no loss; once released, the lease is renewed no more."""
        owned = self.owned
        owned.releasing = True
        answer = 0
        try:
            answer = await self.handles.leases.release(self.session, owned.entry, owned.token, **how)
        finally:
            owned.releasing = False
            owned.released = answer == 1
        return answer

    async def _loop(self, bell: Bell, *, soon: bool = True) -> bool:
        """Serve until stopping or idle; returns True when the session was parked (``soon``: the
        first stray check a second after the start, else :data:`MAX_STRAY_CHECK_SECONDS`)."""
        handles, ctx = self.handles, self.ctx
        idle_since = time.monotonic()
        quiet = STRAY_CHECK_SECONDS if soon else MAX_STRAY_CHECK_SECONDS
        stray_check = idle_since + quiet
        backoff = Backoff()
        while not self.state.stopping.is_set():
            if self.strays_now:
                self.strays_now = False
                quiet, stray_check = STRAY_CHECK_SECONDS, 0.0
            try:
                if time.monotonic() >= stray_check:
                    quiet = min(quiet * 2, MAX_STRAY_CHECK_SECONDS)
                    stray_check = time.monotonic() + quiet
                    # (the answer with those other loops send in this turn; the writes go with the check)
                    await self.flush(together=True, writes=False)
                    if await self._recover_stray():
                        idle_since = time.monotonic()
                        quiet = STRAY_CHECK_SECONDS
                        stray_check = idle_since + quiet
                        continue
                if await self._read_and_dispatch():
                    idle_since = time.monotonic()
                    backoff.reset()
                    continue
                deadline = self.wake_at(ctx) if self.wake_at is not None and self.held is None else None
                if deadline is not None and deadline <= time.monotonic():
                    await self.flush()
                    tick: Callable[[SessionContext], Awaitable[None]] = getattr(self.handler, "tick")  # noqa: B009
                    await tick(ctx)
                    idle_since = time.monotonic()
                    continue
                if (
                    self.leaves is not None
                    and self.held is None
                    and self.leaves(ctx)
                    and time.monotonic() - idle_since > LEAVE_AFTER
                ):
                    await self.flush()
                    left = await self._give_back(tenant=self.owned.tenant)
                    if left == 0:
                        raise FencedError(self.session, handles.role, self.owned.token)
                    self.log.info("session.left")
                    return True
                retire = self.retires is not None and self.held is None and self.retires(ctx)
                if retire or (deadline is None and time.monotonic() - idle_since > handles.park_after):
                    retire = retire or self.on_demand
                    await self.flush()
                    parked = await self._give_back(park=True, seen_last=ctx.last_seen, retire=retire)
                    if parked == 1:
                        self.log.info("session.retired" if retire else "session.parked")
                        return True
                    if parked == 0:
                        raise FencedError(self.session, handles.role, self.owned.token)
                    # Refused: the log holds events past the last this loop handled.  New ones are
                    # read next; those a previous owner's group moved past (an append that passed
                    # its own events, then lost its lease) this loop never reads: what the group
                    # delivered counts as seen, or every look would be refused again at once.
                    ctx.last_seen = max(ctx.last_seen, await ctx.delivered_up_to())
                    idle_since = time.monotonic()
                    continue
                wake_by = min(stray_check, idle_since + handles.park_after)
                if deadline is not None:
                    wake_by = min(wake_by, deadline)
                if self.leaves is not None and self.leaves(ctx):
                    wake_by = min(wake_by, idle_since + LEAVE_AFTER + 0.01)
                await bell.wait(self.mark, max(0.0, wake_by - time.monotonic()))
            except UnavailableError as exc:
                self.log.warning("read.unavailable", error=str(exc), retry_in=backoff.next)
                await backoff.pause()
                # a reply lost with the connection may have left entries pending here
                quiet, stray_check = STRAY_CHECK_SECONDS, 0.0
                continue
            except rexc.ResponseError as exc:
                if not group_lost(exc):
                    raise
                await self.check_lease("its log group is gone")
                await self.ensure_group(after=ctx.last_seen)
                continue
            backoff.reset()
        return False

    async def flush(self, *, together: bool = False, writes: bool = True) -> None:
        """Send the answer held for the next read now (``together``: in one write with the
        answers other loops send in this turn, and the held writes with it), and the writes
        held (unless not ``writes``: the caller sends them)."""
        held, self.held = self.held, None
        if held is not None:
            await self.ctx.answer(*held, together=together)
        if writes:
            await self.ctx.send_writes()

    async def _read_and_dispatch(self) -> bool:
        """Read new entries (never blocking) and dispatch them; False when none came."""
        batch = [Entry.from_stream(raw_id, fields) for raw_id, fields in await self._read()]
        self.hot = bool(batch)
        if not batch:
            return False
        if batch[0].id <= self.ctx.last_seen:
            # A group delivers only ids after the ones it delivered: the log started over.
            await self.check_lease(f"its log delivered {batch[0].id} after {self.ctx.last_seen}")
        crashpoint("after_read")
        self.held = await self.dispatch(self.ctx, batch, recovering=False)
        return True

    async def _read(self) -> list[StreamEntry]:
        """New entries: waiting briefly on a hot connection when the session just had work and
        one is free, else without blocking."""
        hot = self.handles.hot
        if not self.hot or hot is None:
            return await self._read_on(self.handles.client, None)
        try:
            hot.slots.acquire_on_behalf_of_nowait(self)
        except anyio.WouldBlock:
            return await self._read_on(self.handles.client, None)
        try:
            return await self._read_on(hot.client, HOT_BLOCK_MS)
        finally:
            hot.slots.release_on_behalf_of(self)

    async def _read_on(self, client: RedisClient, block_ms: int | None) -> list[StreamEntry]:
        """New entries read on ``client`` (waiting up to ``block_ms``); the writes and the answer
        held for this read go out in the same round trip, and the answer's outcome is handled
        before the read returns."""
        handles, ctx = self.handles, self.ctx
        key = handles.keys.log(self.session)
        if block_ms is None and self.held is not None:
            # Not waiting: anything appended since the last read rang the bell, so the answer
            # goes without a read (with the answers of the loops woken with this one) and the
            # loop reads again only if the bell rang.
            answer, self.held = self.held, None
            await ctx.answer(*answer, together=True)
            await ctx.send_writes()
            return []
        self.mark = self.bell.rung
        held, self.held = self.held, None
        writes = ctx.take_writes()
        if block_ms is None:
            try:
                return await handles.reads.read(key, writes, lost=self._reply_lost)
            except BaseException:
                ctx.hold_again(writes)
                raise
        if held is None and not writes:
            return await client.xreadgroup(handles.role, handles.worker, key, ">", count=READ_COUNT, block=block_ms)
        group = ("XREADGROUP", "GROUP", handles.role, handles.worker, "COUNT", READ_COUNT)
        read = (*group, "BLOCK", block_ms, "STREAMS", key, ">")
        prepared = None if held is None else ctx.prepare_answer(*held)
        try:
            if prepared is not None:
                await handles.log.append_script.load()
            async with client.exchange(*writes, *([] if prepared is None else [prepared.command]), read) as replies:
                if replies is not None:
                    await written(replies, len(writes))
                    writes = []
                    if held is not None and prepared is not None:
                        await ctx.answered(held.entry, prepared, await prepared.outcome(await replies.read()))
                        held = None
                    return stream_entries(await replies.read())
        except (rexc.NoScriptError, UnavailableError):
            if held is None:
                raise  # the loop backs off; entries this read may have taken are recovered as strays
            self._reply_lost()  # (the answer goes alone below, then a read)
        finally:
            ctx.hold_again(writes)  # (not known to be made: they go again, first)
        if held is not None:
            await ctx.answer(*held)
        await ctx.send_writes()
        return await client.xreadgroup(handles.role, handles.worker, key, ">", count=READ_COUNT, block=block_ms)

    def _reply_lost(self) -> None:
        self.strays_now = True

    async def _recover_stray(self) -> bool:
        """Recover entries pending while this loop works on nothing: a delivery whose reply was
        lost with a broken connection, or an entry a stale owner read after this worker took
        the session over.  Nobody is working on them, so they are handled as in flight."""
        ctx = self.ctx
        writes = ctx.take_writes()  # (made first: what this loop handled is not pending)
        try:
            pending = await self.handles.pending.count(self.handles.keys.log(self.session), writes)
        except BaseException:
            ctx.hold_again(writes)
            raise
        if not pending:
            return False
        stray = await self.in_flight()
        if not stray:
            return False
        self.log.warning("session.stray", entries=[e.id for e in stray])
        self.held = await self.dispatch(self.ctx, stray, recovering=True)
        return True

    async def _send_held_answer(self) -> None:
        """Send an answer still held when the loop ends (stopping, cancelled, failed)."""
        if self.held is None and not self.ctx.held_writes:
            return
        try:
            with anyio.move_on_after(self.handles.lease_seconds):
                await self.flush()
        except (FencedError, UnavailableError) as exc:
            # Left unanswered and pending: the next owner recovers it like any in-flight action.
            self.log.warning("session.answer_unsent", error=str(exc))

    async def check_lease(self, what: str) -> None:
        """Raise :class:`FencedError` (the session loop ends) unless this worker still holds the
        session: a lost lease means Redis lost the session, and what this loop knows is stale."""
        if not await self.handles.leases.holds(self.session, self.owned.token):
            self.log.warning("session.state_lost", found=what)
            raise FencedError(self.session, self.handles.role, self.owned.token)

    async def ensure_group(self, *, after: int = 0) -> None:
        """The role's group on the log, delivering the ids after ``after`` (created when missing)."""
        handles = self.handles
        await handles.batch.xgroup_create(handles.keys.log(self.session), handles.role, f"{after}-0")
        # A group made again delivers from ``after``: what the old one delivered says nothing of it.
        self.ctx.delivered = min(self.ctx.delivered, after)

    async def in_flight(self) -> list[Entry]:
        """Entries delivered to some consumer of this role and never acknowledged."""
        handles = self.handles
        key = handles.keys.log(self.session)
        out: list[Entry] = []
        start = "-"
        while True:
            pending = await handles.batch.xpending_range(key, handles.role, min=start, max="+", count=500)
            if not pending:
                return out
            ids = [p["message_id"].decode() for p in pending]
            deliveries = {entry_id(p["message_id"]): int(p["times_delivered"]) for p in pending}
            claimed = await handles.client.xclaim(key, handles.role, handles.worker, ids)
            for raw_id, fields in claimed:
                if fields:
                    entry = Entry.from_stream(raw_id, fields)
                    entry.deliveries = deliveries.get(entry.id, 1)
                    out.append(entry)
            if len(pending) < 500:
                return out
            start = f"({pending[-1]['message_id'].decode()}"

"""The consumer loop of one role in one worker: take sessions, serve them, survive crashes.

An :class:`Owner` runs four kinds of task in one task group:

- **intake** reads new directory entries (bounded ``BLOCK``) while it owns fewer than
  ``capacity`` sessions and acquires them;
- **reclaim** takes over sessions whose owner stopped renewing (``XAUTOCLAIM`` after a lease);
- **renew** pushes every owned lease forward every quarter of a lease; a session whose
  renewal fails is abandoned at once (its fencing token is stale anyway);
- one **session loop** per owned session: it creates the role's consumer group on the log,
  hands entries that were in flight on the previous owner to :meth:`Handler.recover`, then
  reads new entries (``XREADGROUP >``, bounded ``BLOCK``) and hands them, in order, to
  :meth:`Handler.handle`.  Every second it also recovers entries left pending with nobody
  working on them (a delivery whose reply was lost with a broken connection, or one that a
  stale owner read after the takeover).  A handler may hold the answer to a batch's last
  entry (:meth:`SessionContext.answer_soon`): the loop sends it in one write with its next
  read (``bus/exchange.py``), on a connection it keeps for the session.

Failures inside a handler never escape: an entry that keeps failing (or that crashed its
worker) ``max_attempts`` times goes to the dead-letter stream, the session gets an
``error`` event, and the loop goes on.  :class:`UnavailableError` (Postgres or the embedder
down) is not the entry's fault: the loop backs off and retries without counting attempts;
an answer whose append failed that way is appended again (never the action run again).

Shutdown is two-phase: :meth:`Owner.stop` stops intake and lets each session loop finish
its current batch; after the drain deadline the rest is cancelled; releases run shielded
and re-announce each session so a peer takes it at once.

Redis may lose its data under a running owner (a restart without persistence, a failover to
an empty replica, FLUSHALL).  The owner notices and rebuilds, with no restart:

- the directory group is gone (``NOGROUP``): intake or reclaim creates it again and lets go
  of every session it holds, whose lease handles went with it;
- a lease is gone (renewal fails, or the session is announced anew while held): the session
  loop ends, and with it everything the worker kept for the session (fencing token, last
  seen id, the handler's state); the next append announces the session and an owner takes
  it as new;
- the group on a session log is gone, or the log delivers ids at or before the last one this
  loop handled (the log started over): the loop checks its lease and ends as above, never
  re-creating a group that would hand a stale owner the new log's actions.

A role loop that keeps failing records it in :attr:`Owner.failures`: ``/readyz`` turns red
with the loop, its error and since when, until a round succeeds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

import anyio
import msgspec
import redis.exceptions as rexc
import structlog
from anyio.abc import TaskStatus
from msgspec.structs import replace

from riverbed import events, tracing
from riverbed.bus.claims import Claimed, Claims
from riverbed.bus.connection import Client, translate
from riverbed.bus.dlq import DeadLetters
from riverbed.bus.exchange import exchange, held_connection, stream_entries
from riverbed.bus.failures import Failures
from riverbed.bus.faults import crashpoint
from riverbed.bus.keys import PAYLOAD_FIELD, Keys
from riverbed.bus.log import AlreadyAnswered, Fence, Log, PreparedAppend, decode_entry, entry_id
from riverbed.bus.ownership import Claim, Leases
from riverbed.errors import AppendConflict, FencedError, UnavailableError

__all__ = ["Entry", "Handler", "Owner", "OwnerStats", "SessionContext"]

log = structlog.get_logger("riverbed.worker")

READ_COUNT = 100
#: How often an owned session looks for entries pending with nobody working on them.
STRAY_CHECK_SECONDS = 1.0
T = TypeVar("T")


@dataclass
class Entry:
    """One log entry as delivered to a role: its id, the decoded event and the raw payload."""

    id: int
    event: events.Event
    payload: bytes
    deliveries: int = 1

    @property
    def undecodable(self) -> bool:
        return isinstance(self.event, events.Unknown) and "undecodable" in self.event.payload


@dataclass
class OwnerStats:
    """Counters an operator pages on; exported as Prometheus metrics by the worker.

    Handler durations are not kept one by one: each is counted, summed and passed to the
    ``observers`` (the worker's latency histogram), so memory stays constant.
    """

    handled: int = 0
    redeliveries: int = 0
    dead_letters: int = 0
    takeovers: int = 0
    append_conflicts: int = 0
    lost: int = 0
    handler_calls: int = 0
    handler_seconds_total: float = 0.0
    observers: list[Callable[[float], None]] = field(default_factory=list)

    def observe_handler(self, seconds: float) -> None:
        self.handler_calls += 1
        self.handler_seconds_total += seconds
        for observe in self.observers:
            observe(seconds)


class SessionContext:
    """What a handler may do for the session it serves, with the owner's fencing token."""

    def __init__(self, owner: Owner, session: str, token: int) -> None:
        self.owner = owner
        self.session = session
        self.role = owner.role
        self.worker = owner.worker
        self.fence = Fence(owner.role, token)
        self.log = owner.log
        self.last_seen = 0
        self.tenant: str | None = None
        self._soon: tuple[Entry, events.Observation] | None = None
        self.line: Any = None
        """The connection the session loop reads on (standalone Redis; None on a cluster)."""

    async def answer(self, entry: Entry, observation: events.Observation, *, ack: bool = True) -> int | None:
        """Append the one observation answering ``entry`` and acknowledge the entry atomically.

        Returns its id, or None when the action was answered already (then only acks).
        ``ack=False`` leaves the entry pending: the handler is not done with it yet.
        """
        await self.flush()
        # Retried until Redis answers: the one-answer guard makes a repeat of an append that did
        # go through a no-op, and giving up here would make the loop run the action again.
        result = await _retrying(self.prepare_answer(entry, observation, ack=ack).run, self.owner._stopping)
        if not ack:
            return None if isinstance(result, AlreadyAnswered) else result[0]
        return await self.answered(entry, result)

    def answer_soon(self, entry: Entry, observation: events.Observation) -> None:
        """Answer ``entry`` with the owner's next read of the log: one round trip for both.

        For the last entry of a batch (the loop reads next).  Any other write for the session
        sends the answer first, and so does the loop before it waits, parks or lets go.
        """
        if self._soon is not None:
            raise RuntimeError("answer_soon() holds one answer at a time; the first one is not sent yet")
        self._soon = (entry, observation)

    @property
    def holds_answer(self) -> bool:
        return self._soon is not None

    def take_answer(self) -> tuple[Entry, events.Observation] | None:
        """The answer held by :meth:`answer_soon`, for the owner to send (it is no longer held)."""
        held, self._soon = self._soon, None
        return held

    async def flush(self) -> None:
        """Send an answer held by :meth:`answer_soon` now."""
        held = self.take_answer()
        if held is not None:
            await self.answer(*held)

    def prepare_answer(self, entry: Entry, observation: events.Observation, *, ack: bool = True) -> PreparedAppend:
        """The fenced (and, with ``ack``, acknowledging) append of ``observation`` as the answer to ``entry``."""
        changes: dict[str, Any] = {}
        if observation.cause != entry.id:
            changes["cause"] = entry.id
        if observation.tenant is None and self.tenant is not None:
            changes["tenant"] = self.tenant
        if observation.trace is None and entry.event.trace is not None:
            changes["trace"] = tracing.child_of(entry.event.trace)
        obs = replace(observation, **changes) if changes else observation
        return self.log.prepare(
            self.session,
            [(events.encode(obs), entry.id)],
            fence=self.fence,
            ack=(self.role, f"{entry.id}-0") if ack else None,
            pass_own=self.owner.passes_own_answers,
        )

    async def answered(self, entry: Entry, result: list[int] | AlreadyAnswered) -> int | None:
        """Finish an answer's append: the answer's id, or None (acknowledged) when one existed."""
        crashpoint("after_append")
        if isinstance(result, AlreadyAnswered):
            await self.ack([entry.id])
            return None
        return result[0]

    async def append(self, batch: Sequence[events.Event], *, expected_last: int | None = None) -> list[int]:
        await self.flush()
        try:
            result = await self.log.append(self.session, batch, fence=self.fence, expected_last=expected_last)
        except AppendConflict:
            self.owner.stats.append_conflicts += 1
            raise
        if isinstance(result, AlreadyAnswered):
            return []
        return result

    async def ack(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        await self.flush()
        crashpoint("before_ack")
        with translate(self.owner.url):
            await self.owner.redis.xack(self.owner.keys.log(self.session), self.role, *[f"{i}-0" for i in ids])

    async def claim(self, entry: Entry, *, force: bool = False, again: Claimed | None = None) -> Claimed:
        """Claim ``entry`` with the owner's fencing token before running it (``bus/claims.py``);
        :class:`FencedError` when this owner's lease was taken over."""
        await self.flush()
        claims = self.owner.claims
        return await claims.claim(
            self.session, entry.id, self.fence, force=force, again=again, stopping=self.owner._stopping
        )

    async def is_answered(self, action_id: int) -> bool:
        await self.flush()
        with translate(self.owner.url):
            return bool(await self.owner.redis.hexists(self.owner.keys.answers(self.session), str(action_id)))


class Handler(Protocol):
    """A role's behaviour for the sessions it owns."""

    role: str

    async def open(self, ctx: SessionContext) -> None:
        """Called after the session is acquired, before any entry (e.g. fold its settings)."""

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> None:
        """Entries that were in flight on a previous owner (delivered, never acknowledged)."""

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> None:
        """New entries, in log order; acknowledge (or answer) each one."""

    async def close(self, ctx: SessionContext) -> None:
        """Called when the session is released, parked or lost."""


@dataclass
class _Owned:
    entry: str
    token: int
    scope: anyio.CancelScope
    busy: bool = False


class Owner:
    """Serves one role for up to ``capacity`` sessions at a time."""

    def __init__(
        self,
        redis: Client,
        keys: Keys,
        handler: Handler,
        *,
        worker: str,
        capacity: int = 100,
        lease_seconds: float = 5.0,
        park_after: float = 60.0,
        max_attempts: int = 3,
        url: str = "redis",
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
        self.log = Log(redis, keys, url)
        self.passes_own_answers = bool(getattr(handler, "ignores_own_answers", False))
        """The handler never needs its own answers delivered back (the runtime: it handles actions)."""
        self.leases = Leases(redis, keys, self.role, worker=worker, lease_ms=math.ceil(lease_seconds * 1000), url=url)
        self.dlq = DeadLetters(redis, keys, url)
        self.claims = Claims(redis, keys, worker=worker, lease_seconds=lease_seconds, url=url)
        self.owned: dict[str, _Owned] = {}
        self.stats = OwnerStats()
        self.failures = Failures()
        """The role loops failing right now (shown by ``/readyz`` and ``riverbed status``)."""
        self.ready = False
        self._stopping = anyio.Event()
        self._drained = anyio.Event()
        self._taking: set[str] = set()
        self._slot_freed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    # --- lifecycle -------------------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await _retrying(self.leases.ensure_group, self._stopping)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._intake)
            tg.start_soon(self._reclaim)
            tg.start_soon(self._renew)
            self.ready = True
            task_status.started()
            await self._drained.wait()
            tg.cancel_scope.cancel()

    async def drain(self, deadline: float) -> None:
        """Stop taking sessions; let in-flight work finish for up to ``deadline`` seconds, then
        cancel what is left.  Every session is released (and re-announced) before this returns."""
        self._stopping.set()
        await _wait_until(lambda: not any(o.busy for o in self.owned.values()), deadline)
        for owned in list(self.owned.values()):
            owned.scope.cancel()
        await _wait_until(lambda: not self.owned, max(1.0, deadline))
        self._drained.set()

    # --- taking sessions -------------------------------------------------------------------

    def _free(self) -> int:
        return self.capacity - len(self.owned)

    async def _intake(self) -> None:
        for claim in await _retrying(lambda: self.leases.read_own_pending(self.capacity), self._stopping):
            await self._take(claim, reclaimed=True)
        while not self._stopping.is_set():
            if self._free() <= 0:
                self.failures.clear("intake")  # not reading is not failing
                self._slot_freed = anyio.Event()
                with anyio.move_on_after(1.0):
                    await self._slot_freed.wait()
                continue
            try:
                claims = await self.leases.read_new(self._free(), block_ms=1000)
            except Exception as exc:
                # The worker's own loops outlive any failure, a client library's included (seen
                # in redis-py's cluster client while a failover closes connections under a command).
                await self._round_failed("intake", exc)
                continue
            self.failures.clear("intake")
            for claim in claims:
                await self._take(claim, reclaimed=False)

    async def _reclaim(self) -> None:
        period = max(0.05, min(self.lease_seconds / 16, 0.25))
        while not self._stopping.is_set():
            await anyio.sleep(period)
            if self._free() <= 0:
                self.failures.clear("reclaim")
                continue
            try:
                claims = await self.leases.reclaim_stale(self._free())
            except Exception as exc:
                await self._round_failed("reclaim", exc)
                continue
            self.failures.clear("reclaim")
            for claim in claims:
                await self._take(claim, reclaimed=True)

    async def _take(self, claim: Claim, *, reclaimed: bool) -> None:
        """Take ``claim`` if it is free; while Redis is unreachable it stays in the directory."""
        try:
            await self._try_take(claim, reclaimed=reclaimed)
        except UnavailableError as exc:
            log.warning("take.unavailable", role=self.role, session=claim.session, error=str(exc))
        except Exception:
            log.exception("take.failed", role=self.role, session=claim.session)

    async def _try_take(self, claim: Claim, *, reclaimed: bool) -> None:
        if self._stopping.is_set():
            # Read while shutting down: pass it on to a peer at once.
            await self.leases.reannounce(claim)
            return
        if claim.session in self._taking:
            return  # the intake and the reclaimer met the same entry; one of them takes it
        owned = self.owned.get(claim.session)
        if owned is not None:
            if claim.entry == owned.entry:
                return
            if await self.leases.holds(claim.session, owned.token):
                await self.leases.drop(claim)  # a duplicate announce
                return
            # Announced anew while held here: the lease is gone (Redis lost its data), so is
            # everything this worker kept for the session.  End that loop; take the session as new.
            log.warning("session.state_lost", role=self.role, session=claim.session)
            owned.scope.cancel()
            await _wait_until(lambda: self.owned.get(claim.session) is not owned, self.lease_seconds)
            if claim.session in self.owned:
                return  # still closing: the entry stays pending here and is reclaimed after a lease
        self._taking.add(claim.session)
        try:
            await self._acquire(claim, reclaimed=reclaimed)
        finally:
            self._taking.discard(claim.session)

    async def _acquire(self, claim: Claim, *, reclaimed: bool) -> None:
        try:
            got = await self.leases.acquire(claim)
        except UnavailableError as exc:
            log.warning("acquire.unavailable", role=self.role, session=claim.session, error=str(exc))
            return
        if got.token == 0:
            if reclaimed and got.holder_entry == claim.entry:
                await self.leases.hand_back(claim, got.holder, got.left_ms)
            else:
                await self.leases.drop(claim)
            return
        if reclaimed:
            self.stats.takeovers += 1
        log.info("session.acquired", role=self.role, session=claim.session, token=got.token, reclaimed=reclaimed)
        scope = anyio.CancelScope()
        self.owned[claim.session] = _Owned(entry=claim.entry, token=got.token, scope=scope)
        assert self._tg is not None
        self._tg.start_soon(self._serve, claim.session, scope)

    async def _renew(self) -> None:
        # A fixed schedule, four rounds a lease: a round that runs late (a busy event loop) does
        # not push the next one back, so a live owner keeps its lease under load.
        period = self.lease_seconds / 4
        due = anyio.current_time()
        while not self._stopping.is_set():
            due += period
            now = anyio.current_time()
            if due < now - period:
                due = now  # we fell more than a round behind: renew now, then keep the schedule
            await anyio.sleep(max(0.0, due - now))
            snapshot = {s: (o.entry, o.token) for s, o in self.owned.items()}
            crashpoint("during_renew")
            try:
                lost = await self.leases.renew(snapshot)
            except Exception as exc:
                await self._round_failed("renew", exc, pause=False)  # the schedule paces it
                continue
            self.failures.clear("renew")
            for session in lost:
                owned = self.owned.get(session)
                if owned is not None:
                    log.warning("lease.lost", role=self.role, session=session)
                    self.stats.lost += 1
                    owned.scope.cancel()

    # --- serving one session ---------------------------------------------------------------

    async def _serve(self, session: str, scope: anyio.CancelScope) -> None:
        owned = self.owned[session]
        ctx = SessionContext(self, session, owned.token)
        released = False
        bound = log.bind(role=self.role, session=session, worker=self.worker)
        try:
            with scope:
                await self._ensure_log_group(session)
                await self.handler.open(ctx)
                in_flight = await self._in_flight(session)
                if in_flight:
                    bound.info("session.recover", entries=len(in_flight))
                    await self._dispatch(ctx, in_flight, recovering=True)
                async with held_connection(self.redis) as line:
                    ctx.line = line
                    try:
                        released = await self._loop(ctx, owned)
                    finally:
                        ctx.line = None
        except FencedError:
            bound.warning("session.fenced")
        except Exception:
            # A bug or a broken session must not take the worker down: give the session back
            # after a pause (so a persistent failure does not spin) and go on with the others.
            bound.exception("session.failed")
            await anyio.sleep(1.0)
        finally:
            with anyio.CancelScope(shield=True):
                await self._send_held_answer(ctx, bound)
                await self._finish(ctx, owned, released)

    async def _loop(self, ctx: SessionContext, owned: _Owned) -> bool:
        """Serve until stopping or idle; returns True when the session was parked."""
        idle_since = time.monotonic()
        stray_check = idle_since + STRAY_CHECK_SECONDS
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                if time.monotonic() >= stray_check:
                    stray_check = time.monotonic() + STRAY_CHECK_SECONDS
                    await ctx.flush()
                    if await self._recover_stray(ctx, owned):
                        idle_since = time.monotonic()
                        continue
                if await self._read_and_dispatch(ctx, owned):
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > self.park_after:
                    await ctx.flush()
                    parked = await self.leases.release(
                        ctx.session, owned.entry, owned.token, park=True, seen_last=ctx.last_seen
                    )
                    if parked == 1:
                        log.info("session.parked", role=self.role, session=ctx.session)
                        return True
                    if parked == 0:
                        raise FencedError(ctx.session, self.role, owned.token, -1)
                    idle_since = time.monotonic()
            except UnavailableError as exc:
                log.warning("read.unavailable", role=self.role, session=ctx.session, error=str(exc), retry_in=backoff)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                stray_check = 0.0  # a reply lost with the connection may have left entries pending here
                continue
            except rexc.ResponseError as exc:
                if not _group_lost(exc):
                    raise
                await self._check_lease(ctx, owned, "its log group is gone")
                await self._ensure_log_group(ctx.session, after=ctx.last_seen)
                continue
            backoff = 0.1
        return False

    async def _read_and_dispatch(self, ctx: SessionContext, owned: _Owned) -> bool:
        """Read new entries (bounded block) and dispatch them; False when none came."""
        entries = await self._read(ctx, owned)
        batch = [_entry(raw_id, fields) for raw_id, fields in entries]
        if not batch:
            return False
        if batch[0].id <= ctx.last_seen:
            # A group delivers only ids after the ones it delivered: the log started over.
            await self._check_lease(ctx, owned, f"its log delivered {batch[0].id} after {ctx.last_seen}")
        crashpoint("after_read")
        owned.busy = True
        try:
            await self._dispatch(ctx, batch, recovering=False)
        finally:
            owned.busy = ctx.holds_answer  # busy until that answer is out (a drain waits for it)
        return True

    async def _read(self, ctx: SessionContext, owned: _Owned) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """New entries (bounded block); an answer held by ``answer_soon`` goes out in the same
        round trip, and its outcome is handled before the read returns."""
        key = self.keys.log(ctx.session)
        read = ("XREADGROUP", "GROUP", self.role, self.worker, "COUNT", READ_COUNT, "BLOCK", 500, "STREAMS", key, ">")
        held = ctx.take_answer()
        if held is not None:
            entry, observation = held
            prepared = ctx.prepare_answer(entry, observation)
            answered = False
            try:
                with translate(self.url):
                    async with exchange(self.redis, prepared.command, read, connection=ctx.line) as replies:
                        if replies is not None:
                            await ctx.answered(entry, await prepared.outcome(await replies.read()))
                            answered = True
                            owned.busy = False
                            return stream_entries(await replies.read())
            except (rexc.NoScriptError, UnavailableError):
                if answered:
                    raise  # the loop backs off; entries this read may have taken are recovered as strays
            if not answered:
                await ctx.answer(entry, observation)
                owned.busy = False
        if ctx.line is not None:
            with translate(self.url):
                async with exchange(self.redis, read, connection=ctx.line) as replies:
                    assert replies is not None
                    return stream_entries(await replies.read())
        with translate(self.url):
            reply = await self.redis.xreadgroup(self.role, self.worker, {key: ">"}, count=READ_COUNT, block=500)
        return [(raw_id, fields) for _s, entries in reply or () for raw_id, fields in entries]

    async def _recover_stray(self, ctx: SessionContext, owned: _Owned) -> bool:
        """Recover entries pending while this loop works on nothing: a delivery whose reply was
        lost with a broken connection, or an entry a stale owner read after this worker took
        the session over.  Nobody is working on them, so they are handled as in flight."""
        stray = await self._in_flight(ctx.session)
        if not stray:
            return False
        log.warning("session.stray", role=self.role, session=ctx.session, entries=[e.id for e in stray])
        owned.busy = True
        try:
            await self._dispatch(ctx, stray, recovering=True)
        finally:
            owned.busy = False
        return True

    async def _send_held_answer(self, ctx: SessionContext, bound: Any) -> None:
        """Send an answer still held when the loop ends (stopping, cancelled, failed)."""
        if not ctx.holds_answer:
            return
        try:
            with anyio.move_on_after(self.lease_seconds):
                await ctx.flush()
        except (FencedError, UnavailableError) as exc:
            # Left unanswered and pending: the next owner recovers it like any in-flight action.
            bound.warning("session.answer_unsent", error=str(exc))

    async def _finish(self, ctx: SessionContext, owned: _Owned, parked: bool) -> None:
        try:
            await self.handler.close(ctx)
        except Exception:
            log.exception("handler.close_failed", role=self.role, session=ctx.session)
        if self.owned.get(ctx.session) is owned:
            del self.owned[ctx.session]
        if not parked:
            try:
                await self.leases.release(ctx.session, owned.entry, owned.token)
            except UnavailableError as exc:
                log.warning("release.unavailable", role=self.role, session=ctx.session, error=str(exc))
        self._slot_freed.set()

    async def _check_lease(self, ctx: SessionContext, owned: _Owned, what: str) -> None:
        """Raise :class:`FencedError` (the session loop ends) unless this worker still holds the
        session: a lost lease means Redis lost the session, and what this loop knows is stale."""
        if not await self.leases.holds(ctx.session, owned.token):
            log.warning("session.state_lost", role=self.role, session=ctx.session, found=what)
            raise FencedError(ctx.session, self.role, owned.token, 0)

    async def _rebuild_directory(self) -> None:
        """The role's directory group is gone: create it again and let go of every session held
        (their lease handles went with it; a release re-announces a session whose lease stands)."""
        await self.leases.ensure_group()
        held = list(self.owned.items())
        log.warning("directory.rebuilt", role=self.role, released=sorted(self.owned))
        for _session, owned in held:
            owned.scope.cancel()
        await _wait_until(lambda: all(self.owned.get(s) is not o for s, o in held), self.lease_seconds)

    async def _round_failed(self, loop: str, exc: Exception, *, pause: bool = True) -> None:
        """A round of a role loop failed: rebuild the directory group when it is gone, else
        record the failure (``/readyz`` shows it until a round succeeds) and back off."""
        if _group_lost(exc):
            try:
                await self._rebuild_directory()
            except Exception as again:  # recorded and retried like the round itself
                exc = again
            else:
                return
        failure = self.failures.record(loop, exc)
        if isinstance(exc, UnavailableError):
            log.warning(f"{loop}.unavailable", role=self.role, error=str(exc), retry_in=failure.retry_in)
        else:
            log.warning(
                f"{loop}.failed",
                role=self.role,
                error=failure.error,
                attempts=failure.attempts,
                exc_info=exc if failure.attempts == 1 else False,
            )
        if pause:
            await anyio.sleep(failure.retry_in)

    async def _ensure_log_group(self, session: str, *, after: int = 0) -> None:
        """The role's group on the log, delivering the ids after ``after`` (created when missing)."""
        with translate(self.url):
            try:
                await self.redis.xgroup_create(self.keys.log(session), self.role, id=f"{after}-0", mkstream=True)
            except rexc.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _in_flight(self, session: str) -> list[Entry]:
        """Entries delivered to some consumer of this role and never acknowledged."""
        key = self.keys.log(session)
        out: list[Entry] = []
        start = "-"
        while True:
            with translate(self.url):
                pending = await self.redis.xpending_range(key, self.role, min=start, max="+", count=500)
            if not pending:
                return out
            ids = [p["message_id"] for p in pending]
            deliveries = {entry_id(p["message_id"]): int(p["times_delivered"]) for p in pending}
            with translate(self.url):
                claimed = await self.redis.xclaim(key, self.role, self.worker, 0, ids)
            for raw_id, fields in claimed:
                if fields:
                    entry = _entry(raw_id, fields)
                    entry.deliveries = deliveries.get(entry.id, 1)
                    out.append(entry)
            if len(pending) < 500:
                return out
            start = f"({pending[-1]['message_id'].decode()}"

    async def _dispatch(self, ctx: SessionContext, batch: list[Entry], *, recovering: bool) -> None:
        """Hand a batch to the handler; count failures, dead-letter poison, retry the rest."""
        attempts: dict[int, int] = {}
        failures: dict[int, str] = {}  # an entry's last error, for its dead letter
        todo = batch
        backoff = 0.1
        while todo:
            poison = [e for e in todo if e.undecodable or e.deliveries + attempts.get(e.id, 0) > self.max_attempts]
            if poison:
                await self.dead_letter(
                    ctx,
                    [
                        (
                            e,
                            "undecodable payload"
                            if e.undecodable
                            else "failed too many times" + (f": {failures[e.id]}" if e.id in failures else ""),
                            e.deliveries + attempts.get(e.id, 0),
                        )
                        for e in poison
                    ],
                )
            todo = [e for e in todo if e not in poison]
            if not todo:
                break
            if recovering:
                self.stats.redeliveries += len(todo)
            started = time.perf_counter()
            try:
                if recovering:
                    await self.handler.recover(ctx, todo)
                else:
                    await self.handler.handle(ctx, todo)
            except FencedError:
                raise
            except (UnavailableError, AppendConflict) as exc:
                # Not the entry's fault (a service is down, or the log moved): retry, uncounted.
                log.warning("handler.retry", role=self.role, session=ctx.session, error=str(exc))
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                todo = await _retrying(partial(self._unacked, ctx, todo), self._stopping)
                continue
            except Exception as exc:
                log.exception("handler.failed", role=self.role, session=ctx.session, error=str(exc))
                for entry in todo:
                    attempts[entry.id] = attempts.get(entry.id, 0) + 1
                    failures[entry.id] = f"{type(exc).__name__}: {exc}"
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                todo = await _retrying(partial(self._unacked, ctx, todo), self._stopping)
                continue
            finally:
                self.stats.observe_handler(time.perf_counter() - started)
            self.stats.handled += len(todo)
            ctx.last_seen = max(ctx.last_seen, todo[-1].id)
            break

    async def _unacked(self, ctx: SessionContext, entries: list[Entry]) -> list[Entry]:
        """The entries of ``entries`` that are still pending (a failed batch may be half done)."""
        await ctx.flush()
        key = self.keys.log(ctx.session)
        with translate(self.url):
            pending = await self.redis.xpending_range(
                key, self.role, min=f"{entries[0].id}-0", max=f"{entries[-1].id}-0", count=len(entries)
            )
        still = {entry_id(p["message_id"]) for p in pending}
        return [e for e in entries if e.id in still]

    async def dead_letter(self, ctx: SessionContext, poison: Sequence[tuple[Entry, str, int]]) -> None:
        """Move entries (with the reason and attempts) to the dead-letter stream and tell the
        session: one ``error`` each, answering the entry if it is an action of this role.  A few
        round trips per batch, however many entries: a flood of garbage cannot stall a session."""
        self.stats.dead_letters += len(poison)
        letters = await self.dlq.add_many(ctx.session, self.role, [(e.id, r, a, e.payload) for e, r, a in poison])
        notices: list[events.Error] = []
        for (entry, reason, attempts), letter in zip(poison, letters, strict=True):
            log.error("entry.dead_lettered", role=self.role, session=ctx.session, event_id=entry.id, reason=reason)
            notices.append(
                events.Error(
                    content=f"event {entry.id} was moved to the dead-letter stream by the {self.role} role "
                    f"({reason}, {attempts} attempts); see `riverbed dlq list` (dead letter {letter})",
                    reason="dead_letter",
                    retryable=False,
                    source="system",
                    cause=entry.id if _answered_by(entry) == self.role else None,
                    tenant=ctx.tenant,
                )
            )
        if not await ctx.append(notices):
            # One of them was answered already (a redelivery): the batch appended nothing; go one by one.
            for (entry, _reason, _attempts), notice in zip(poison, notices, strict=True):
                if notice.cause is not None:
                    await ctx.answer(entry, notice)
                else:
                    await ctx.append([notice])
        await ctx.ack([e.id for e, _reason, _attempts in poison])


def _answered_by(entry: Entry) -> str | None:
    """The role that answers ``entry``: its action kind's, also when the payload names an
    action kind but does not decode (a field of the wrong type): its sender waits all the same."""
    event = entry.event
    if isinstance(event, events.Action):
        return type(event).answered_by
    if not entry.undecodable:
        return None
    try:
        raw = msgspec.msgpack.decode(entry.payload)
    except msgspec.DecodeError:
        return None
    kind = raw.get("kind") if isinstance(raw, dict) else None
    cls = events.kinds().get(kind) if isinstance(kind, str) else None
    if cls is not None and issubclass(cls, events.Action):
        return cls.answered_by
    return None


def _group_lost(exc: Exception) -> bool:
    """Whether Redis answered that a consumer group (or its stream) does not exist (any more)."""
    return isinstance(exc, rexc.ResponseError) and str(exc).startswith(("NOGROUP", "UNBLOCKED"))


def _entry(raw_id: bytes, fields: dict[bytes, bytes]) -> Entry:
    event_id = entry_id(raw_id)
    payload = fields.get(PAYLOAD_FIELD, b"")
    return Entry(id=event_id, event=decode_entry(payload, event_id), payload=payload)


async def _wait_until(done: Callable[[], bool], timeout: float) -> None:
    """Poll ``done`` (cheap, in-process state) every 20 ms for at most ``timeout`` seconds."""
    with anyio.move_on_after(timeout):
        while not done():  # noqa: ASYNC110  (the state is plain attributes, not an Event)
            await anyio.sleep(0.02)


async def _retrying(fn: Callable[[], Awaitable[T]], stopping: anyio.Event) -> T:
    """Call ``fn`` until Redis answers (backing off), unless the owner is stopping."""
    backoff = 0.1
    while True:
        try:
            return await fn()
        except UnavailableError as exc:
            if stopping.is_set():
                raise
            log.warning("redis.unavailable", error=str(exc), retry_in=backoff)
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

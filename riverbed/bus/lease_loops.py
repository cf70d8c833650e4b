"""The loops that take and keep session leases (``bus/leases.py``): intake, reclaim and renew,
for one role in one worker.

- **intake** reads new directory entries (bounded ``BLOCK``) while the owner has room, and
  acquires them, sharing the owner's capacity fairly among tenants (:meth:`LeaseLoops._read_fairly`);
- **reclaim** takes over sessions whose owner stopped renewing (``XAUTOCLAIM`` after a lease);
- **renew** pushes every owned lease forward every quarter of a lease; a session whose
  renewal fails is abandoned at once (its fencing token is stale anyway).

Redis may lose its data under a running owner (a restart without persistence, a failover to
an empty replica, FLUSHALL).  When the directory group is gone (``NOGROUP``), intake or
reclaim creates it again and lets go of every session held, whose lease handles went with it.
A session announced anew while held here lost its lease the same way: its loop ends, and the
session is taken as new.  A loop that keeps failing is recorded in the owner's failures
(``/readyz`` turns red until a round succeeds).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial

import anyio
import structlog

from riverbed.bus.backoff import retry_unavailable
from riverbed.bus.connection import group_lost
from riverbed.bus.faults import crashpoint
from riverbed.bus.handles import Handles, OwnerState
from riverbed.bus.leases import Claim
from riverbed.errors import UnavailableError

__all__ = ["LeaseLoops", "StartSession"]

#: Serve a session just acquired: (session, entry, token, (tenant, created) or None, when the
#: acquire that set its lease was sent, ``time.monotonic()``, whether it was taken over: reclaimed
#: from an owner that stopped renewing, or this worker's before a restart).
StartSession = Callable[[str, str, int, tuple[str | None, str] | None, float, bool], None]
#: How many more sessions the role may take now, owning so many (None: up to its capacity).
Room = Callable[[int], "int | None"]
#: How often a paced intake looks again whether the role has room.
PACED_POLL = 0.1

log = structlog.get_logger("riverbed.worker")


class LeaseLoops:
    """The intake, reclaim and renew loops of one owner, for up to ``capacity`` sessions.

    ``start_session`` is how it hands the owner a session it just acquired (the session's
    entry, fencing token, and tenant and creation stamp when read); :attr:`slot_freed` is set
    by the owner when a session loop ended.  ``room``, when the role paces what it takes (the
    agent role: ``workers/agent_pace.py``), bounds intake below the capacity; reclaim, which
    takes over sessions a dead owner left in the middle of their work, goes by the capacity
    alone, ahead of new sessions waiting for room.
    """

    def __init__(
        self,
        handles: Handles,
        state: OwnerState,
        *,
        capacity: int,
        start_session: StartSession,
        room: Room | None = None,
        serves: Callable[[str], bool] | None = None,
        tenant_share: float = 1.0,
    ) -> None:
        self.handles = handles
        self.state = state
        self.capacity = capacity
        self.tenant_share = tenant_share
        """The part of ``capacity`` one tenant may hold (``RIVERBED_TENANT_SHARE``)."""
        self.serves = serves
        """Whether an owned session counts toward its tenant's share (None: every one does; the
        agent role leaves out runs waiting only for their sub-agents)."""
        self.room = room
        self.start_session = start_session
        self.leases = handles.leases
        self.role = handles.role
        self._taking: set[str] = set()
        self._sweep_due = math.inf
        """when (``time.monotonic()``) the reclaim loop next scans the pending entries whatever the
        consumers say"""
        self._turn = 0
        """how many intake reads were made: the tenant read first moves on by one each read"""
        self.slot_freed = anyio.Event()

    def free(self) -> int:
        """How many more sessions intake may take now."""
        owned = len(self.state.owned)
        room = None if self.room is None else self.room(owned)
        return self.capacity - owned if room is None else min(self.capacity - owned, room)

    def spare(self) -> int:
        """How many more sessions the capacity allows (what reclaim may take)."""
        return self.capacity - len(self.state.owned)

    def share(self, tenant: str) -> int:
        """How many sessions ``tenant`` may hold here.  Sessions without a tenant (an operator's
        own, made with the Redis credentials) are not held to a share."""
        return max(1, int(self.capacity * self.tenant_share)) if tenant else self.capacity

    def held(self) -> Counter[str]:
        """The sessions held here that count toward their tenants' shares, by tenant ('' none).

        Without ``serves`` every owned session counts: the owner's count, kept as sessions are
        owned and let go (an intake round of a worker holding thousands of sessions would walk
        them all; a session's tenant is fixed when it is taken)."""
        state, serves = self.state, self.serves
        if serves is not None:
            return Counter(owned.tenant or "" for session, owned in state.owned.items() if serves(session))
        return state.tenants.copy()

    async def intake(self) -> None:
        state = self.state
        for claim in await retry_unavailable(
            lambda: self.leases.read_own_pending(self.capacity), stopping=state.stopping
        ):
            await self.take(claim, reclaimed=True)
        while not state.stopping.is_set():
            if self.free() <= 0:
                state.failures.clear("intake")  # not reading is not failing
                self.slot_freed = anyio.Event()
                with anyio.move_on_after(1.0 if self.room is None else PACED_POLL):
                    await self.slot_freed.wait()
                continue
            await self._round("intake", self._read_fairly, reclaimed=False)

    async def _read_fairly(self) -> list[Claim]:
        """The sessions to take now, shared fairly among tenants.

        A tenant holding its :meth:`share` of this worker takes no more here: the entries of
        its sessions read meanwhile are set aside in its own stream (``Leases.set_aside``),
        where this worker looks again once the tenant holds less, and where every other worker
        looks as long as the tenant holds less there.  So a tenant with a thousand sessions
        waiting delays another tenant's new session by one read, not by a thousand sessions;
        and the set-aside streams are read one entry of each tenant in turn.  With room for
        fewer sessions than there are tenants waiting, only as many tenants' streams are read as
        there is room for, starting one tenant further on each read: each tenant's turn comes,
        and the sessions of the tenants not read keep their order (an entry read and not taken
        goes to the end of its stream)."""
        free = self.free()
        held = self.held()
        tenants = sorted(t for t in await self.leases.refresh_waiting() if held[t] < self.share(t))
        if tenants:
            first = self._turn % len(tenants)
            tenants = (tenants[first:] + tenants[:first])[:free]
        self._turn += 1
        per_stream = max(1, -(-free // (len(tenants) + 1)))
        claims = await self.leases.with_tenants(await self.leases.read_new(per_stream, block_ms=1000, tenants=tenants))
        take: list[Claim] = []
        aside: list[Claim] = []
        for claim in claims:
            tenant = claim.tenant or ""
            if len(take) < free and held[tenant] < self.share(tenant):
                take.append(claim)
                held[tenant] += 1
            else:
                aside.append(claim)
        if aside:
            await self.leases.set_aside(aside)
        return take

    async def reclaim(self) -> None:
        # Each round asks whether a holder of entries went quiet (a few µs a consumer); every
        # lease (from a phase of its own) and a lease after this worker left an entry behind,
        # a round scans the entries all the same (``Leases.reclaim_stale``).
        state = self.state
        lease = self.handles.lease_seconds
        period = max(0.05, min(lease / 16, 0.25))
        self._sweep_due = min(self._sweep_due, time.monotonic() + random.uniform(0, lease))
        while not state.stopping.is_set():
            await anyio.sleep(period)
            if self.spare() <= 0:
                state.failures.clear("reclaim")
                continue
            sweep = time.monotonic() >= self._sweep_due
            if sweep:
                self._sweep_due = time.monotonic() + lease
            reclaim = partial(self.leases.reclaim_stale, self.spare(), sweep=sweep)
            await self._round("reclaim", reclaim, reclaimed=True)

    def _left_behind(self) -> None:
        """An entry read here was not taken: it stays pending here, and comes due after a lease
        (this worker's next sweep is then just past it)."""
        self._sweep_due = min(self._sweep_due, time.monotonic() + self.handles.lease_seconds * 1.05)

    async def renew(self) -> None:
        # A fixed schedule, four rounds a lease: a round that runs late (a busy event loop) does
        # not push the next one back, so a live owner keeps its lease under load.
        state = self.state
        period = self.handles.lease_seconds / 4
        due = anyio.current_time()
        while not state.stopping.is_set():
            due += period
            now = anyio.current_time()
            if due < now - period:
                due = now  # we fell more than a round behind: renew now, then keep the schedule
            await anyio.sleep(max(0.0, due - now))
            # (Not the sessions whose loops gave their leases back and are closing: renewing a
            # released lease fails, and a handler's close can outlast many rounds.)
            snapshot = {s: (o.entry, o.token) for s, o in state.owned.items() if not o.released}
            if snapshot:  # (the fault suite's point: a crash while this owner holds a session)
                crashpoint("during_renew")
            sent = time.monotonic()
            try:
                renewed = await self.leases.renew(snapshot)
            except Exception as exc:
                await self._round_failed("renew", exc, pause=False)  # the schedule paces it
                continue
            state.failures.clear("renew")
            for session in renewed.lost:
                owned = state.owned.get(session)
                if owned is not None and not (owned.released or owned.releasing):  # (else given back meanwhile)
                    log.warning("lease.lost", role=self.role, session=session)
                    state.stats.lost += 1
                    owned.lost = True
                    owned.scope.cancel()
            unconfirmed = renewed.lost | renewed.unanswered
            for session, (_entry, token) in snapshot.items():
                owned = state.owned.get(session)
                if owned is not None and owned.token == token and session not in unconfirmed:
                    owned.renewed = sent

    async def _round(self, loop: str, read: Callable[[], Awaitable[list[Claim]]], *, reclaimed: bool) -> None:
        """One round of intake or reclaim: read claims, take them; a failure is recorded (and
        backed off) by :meth:`_round_failed`.  The worker's own loops outlive any failure, a
        client library's included (seen in redis-py's cluster client while a failover closes
        connections under a command)."""
        try:
            claims = await read()
        except Exception as exc:
            await self._round_failed(loop, exc)
            return
        self.state.failures.clear(loop)
        await self._take_all(claims, reclaimed=reclaimed)

    async def _take_all(self, claims: list[Claim], *, reclaimed: bool) -> None:
        """Take many sessions at once: a thousand new sessions are acquired side by side, not
        one round trip after the other (the worker's connection pool bounds the concurrency)."""
        if len(claims) == 1:
            await self.take(claims[0], reclaimed=reclaimed)
            return
        async with anyio.create_task_group() as tg:
            for claim in claims:
                tg.start_soon(partial(self.take, claim, reclaimed=reclaimed))

    async def take(self, claim: Claim, *, reclaimed: bool) -> None:
        """Take ``claim`` if it is free; while Redis is unreachable it stays in the directory."""
        try:
            await self._try_take(claim, reclaimed=reclaimed)
        except UnavailableError as exc:
            log.warning("take.unavailable", role=self.role, session=claim.session, error=str(exc))
            self._left_behind()
        except Exception:
            log.exception("take.failed", role=self.role, session=claim.session)
            self._left_behind()

    async def _try_take(self, claim: Claim, *, reclaimed: bool) -> None:
        state = self.state
        if state.stopping.is_set():
            # Read while shutting down: pass it on to a peer at once.
            await self.leases.reannounce(claim)
            return
        if claim.session in self._taking:
            return  # the intake and the reclaimer met the same entry; one of them takes it
        owned = state.owned.get(claim.session)
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
            await state.wait_for(lambda: state.owned.get(claim.session) is not owned, self.handles.lease_seconds)
            if claim.session in state.owned:
                self._left_behind()  # still closing: the entry stays pending here
                return
        self._taking.add(claim.session)
        try:
            await self._acquire(claim, reclaimed=reclaimed)
        finally:
            self._taking.discard(claim.session)

    async def _acquire(self, claim: Claim, *, reclaimed: bool) -> None:
        sent = time.monotonic()
        try:
            got = await self.leases.acquire(claim)
        except UnavailableError as exc:
            log.warning("acquire.unavailable", role=self.role, session=claim.session, error=str(exc))
            self._left_behind()
            return
        if got.token == 0:
            if reclaimed and got.holder_entry == claim.entry:
                await self.leases.hand_back(claim, got.holder, got.left_ms)
            else:
                await self.leases.drop(claim)
            return
        if reclaimed:
            self.state.stats.takeovers += 1
        log.info("session.acquired", role=self.role, session=claim.session, token=got.token, reclaimed=reclaimed)
        self.start_session(claim.session, claim.entry, got.token, got.meta, sent, reclaimed)

    async def _rebuild_directory(self) -> None:
        """The role's directory group is gone: create it again and let go of every session held
        (their lease handles went with it; a release re-announces a session whose lease stands)."""
        state = self.state
        await self.leases.ensure_group()
        held = list(state.owned.items())
        log.warning("directory.rebuilt", role=self.role, released=sorted(state.owned))
        for _session, owned in held:
            owned.scope.cancel()
        await state.wait_for(lambda: all(state.owned.get(s) is not o for s, o in held), self.handles.lease_seconds)

    async def _round_failed(self, loop: str, exc: Exception, *, pause: bool = True) -> None:
        """A round of a role loop failed: rebuild the directory group when it is gone, else
        record the failure (``/readyz`` shows it until a round succeeds) and back off."""
        if group_lost(exc):
            try:
                await self._rebuild_directory()
            except Exception as again:  # recorded and retried like the round itself
                exc = again
            else:
                return
        failure = self.state.failures.record(loop, exc)
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

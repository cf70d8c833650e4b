"""What an owner hands its rooms: a frozen bundle of handles, and the little state they share.

An :class:`~riverbed.bus.consumer.Owner` is made of rooms (``bus/lease_loops.py``,
``bus/session_loop.py``, ``bus/dispatch.py`` and the handler-facing
:class:`~riverbed.bus.handling.SessionContext`).  None of them receives the owner:

- :class:`Handles` is what they talk to Redis through (the client, the keys, the log, the
  leases, the claims, the dead letters, the grouped reads and writes, the wake-ups) and the
  terms they run under (role, worker, lease, park and attempt limits).  It is frozen: a room
  cannot swap a handle under another;
- :class:`OwnerState` is what they really share: the sessions owned, the counters, the loops
  failing, whether the owner is stopping, and a "the owned sessions changed" signal;
- where one room must tell another something (a session was acquired, a loop ended), the owner
  passes it a plain callable.

So a role's handler can be driven through a ``SessionContext`` made from a ``Handles`` alone,
without an owner taking sessions (``tests/test_handles.py``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import anyio
import msgspec

from riverbed.bus.action_claims import Claims
from riverbed.bus.dlq import DeadLetters
from riverbed.bus.failures import Failures
from riverbed.bus.grouped import Batched, GroupedAnswers, GroupedPending, GroupedReads
from riverbed.bus.keys import Keys
from riverbed.bus.leases import Leases
from riverbed.bus.log import Log
from riverbed.bus.redis_client import RawClient, RedisClient, as_client
from riverbed.bus.wakeups import Wakeups

E = TypeVar("E", bound=msgspec.Struct)

__all__ = ["READ_COUNT", "Handles", "HotReads", "Masks", "Owned", "OwnerState", "OwnerStats"]

#: Entries one read of a session's log asks for.
READ_COUNT = 100


@dataclass
class HotReads:
    """A few connections of a worker's on which busy sessions wait for their next entry
    (``bus/session_loop.py``); ``slots`` bounds how many wait at once (one connection each)."""

    client: RedisClient
    slots: anyio.CapacityLimiter


class Masks(Protocol):
    """What masks the tenants' secrets in everything a role appends (``agent/secrets.py``'s
    ``TenantSecrets``): ``refresh`` reads a tenant's values again when its copy is old, and
    ``mask_event`` replaces every value, and its encoded forms, in an event's strings."""

    async def refresh(self, tenant: str | None) -> None: ...

    def mask_event(self, tenant: str | None, event: E) -> E: ...


@dataclass(frozen=True)
class Handles:
    """The handles one role's owner in one worker works through, and the terms it runs under."""

    client: RedisClient
    """The typed adapter every command goes through."""
    keys: Keys
    role: str
    worker: str
    batch: Batched
    """The commands of taking a session, sent together for the sessions taken at once."""
    log: Log
    leases: Leases
    claims: Claims
    dlq: DeadLetters
    reads: GroupedReads
    answers: GroupedAnswers
    pending: GroupedPending
    """The sessions' reads without waiting, answers sent on their own and checks for stray
    entries go together when their loops ask together (``bus/grouped.py``)."""
    wakeups: Wakeups
    hot: HotReads | None = None
    """Without it every read is a non-blocking one after a wake-up."""
    masks: Masks | None = None
    """Without it nothing appended is masked (a deployment with no secrets key)."""
    lease_seconds: float = 5.0
    park_after: float = 60.0
    max_attempts: int = 3

    @classmethod
    def open(
        cls,
        redis: RawClient | RedisClient,
        keys: Keys,
        role: str,
        *,
        worker: str,
        wakeups: Wakeups,
        lease_seconds: float = 5.0,
        park_after: float = 60.0,
        max_attempts: int = 3,
        url: str = "redis",
        hot: HotReads | None = None,
        masks: Masks | None = None,
    ) -> Handles:
        """The handles of ``role`` for ``worker`` over one Redis client (made from it, none started)."""
        client = as_client(redis, url)
        batch = Batched(client)
        lease_ms = math.ceil(lease_seconds * 1000)
        return cls(
            client=client,
            keys=keys,
            role=role,
            worker=worker,
            batch=batch,
            log=Log(client, keys, url, batch=batch),
            leases=Leases(client, keys, role, worker=worker, lease_ms=lease_ms, url=url, batch=batch),
            claims=Claims(client, keys, worker=worker, lease_seconds=lease_seconds, url=url),
            dlq=DeadLetters(client, keys, url),
            reads=GroupedReads(client, role, worker, READ_COUNT),
            answers=GroupedAnswers(client),
            pending=GroupedPending(client, role),
            wakeups=wakeups,
            hot=hot,
            masks=masks,
            lease_seconds=lease_seconds,
            park_after=park_after,
            max_attempts=max_attempts,
        )


@dataclass
class Owned:
    """A session this owner holds: its directory entry, fencing token and loop's cancel scope."""

    entry: str
    token: int
    scope: anyio.CancelScope
    lost: bool = False
    """Its lease renewal failed (another owner holds it now): the loop was cancelled for it."""
    released: bool = False
    """Its loop gave the lease back (parked, retired or left) and is closing: not renewed, and a
    renewal that finds the lease gone (sent before the release, answered after it) reports no loss."""
    releasing: bool = False
    """Its loop's release is on its way: a renewal answered meanwhile that finds the lease gone
    (Redis ran the release first) reports no loss.  (It is still renewed: a refused release
    leaves the lease in place, and the release may wait behind a busy connection pool.)"""
    meta: tuple[str | None, str] | None = None
    """The session's tenant and creation stamp as the acquire read them (None: not read)."""
    renewed: float = -math.inf
    """When (``time.monotonic()``) the last renewal Redis confirmed was sent, or the acquire
    that set the lease: the lease holds for a lease from then (``SessionContext.holds``)."""

    @property
    def tenant(self) -> str | None:
        """The session's tenant ('' none), or None when the acquire did not read it."""
        return None if self.meta is None else (self.meta[0] or "")


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


class OwnerState:
    """What an owner's rooms share: the sessions owned, the counters, the failing loops, and
    whether the owner is stopping.  Made inside the event loop (it holds anyio events)."""

    def __init__(self) -> None:
        self.owned: dict[str, Owned] = {}
        """the sessions owned now (changed only by :meth:`own` and :meth:`disown`)"""
        self.tenants: Counter[str] = Counter()
        """:attr:`owned` counted by tenant ('' none), kept with it: an intake round of a worker
        holding thousands of sessions reads it instead of walking them"""
        self.stats = OwnerStats()
        self.failures = Failures()
        """The role loops failing right now (shown by ``/readyz`` and ``riverbed status``)."""
        self.stopping = anyio.Event()
        self._changed = anyio.Event()

    def own(self, session: str, owned: Owned) -> None:
        """``session`` is owned now (under ``owned``)."""
        before = self.owned.get(session)
        if before is not None:
            self._count(before, -1)
        self.owned[session] = owned
        self._count(owned, 1)

    def disown(self, session: str, owned: Owned) -> None:
        """``session`` is no longer owned, if ``owned`` is still what holds it."""
        if self.owned.get(session) is owned:
            del self.owned[session]
            self._count(owned, -1)

    def _count(self, owned: Owned, by: int) -> None:
        """Move :attr:`tenants` by ``by`` for ``owned``'s tenant; a tenant holding none is dropped
        (the count stays as long as the tenants held now, not every tenant ever held)."""
        tenant = owned.tenant or ""
        left = self.tenants[tenant] + by
        if left:
            self.tenants[tenant] = left
        else:
            del self.tenants[tenant]

    def changed(self) -> None:
        """The owned sessions changed: wake :meth:`wait_for`."""
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, done: Callable[[], bool], timeout: float) -> None:
        """Wait until ``done()`` (about the owned sessions) holds, for at most ``timeout`` seconds."""
        with anyio.move_on_after(timeout):
            while not done():
                await self._changed.wait()

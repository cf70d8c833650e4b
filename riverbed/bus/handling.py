"""What a role's handler sees of the consumer loop: entries, the session context, the protocol.

A :class:`Handler` gets the entries of one session in log order and answers or acknowledges
each one through its :class:`SessionContext`.  For the batch's last action it may instead
return an :class:`Answer`: the session loop sends it in one write with its next read
(``bus/session_loop.py``), one round trip for both.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import anyio
import msgspec
from msgspec.structs import replace

from riverbed import events, tracing
from riverbed.bus.action_claims import Claimed
from riverbed.bus.backoff import retry_unavailable
from riverbed.bus.faults import crashpoint
from riverbed.bus.grouped import ALONE
from riverbed.bus.handles import Handles, Owned, OwnerStats
from riverbed.bus.keys import PAYLOAD_FIELD
from riverbed.bus.log import AlreadyAnswered, Fence, PreparedAppend, answered_cause, decode_entry, entry_id
from riverbed.bus.redis_client import Arg
from riverbed.errors import AppendConflict

__all__ = ["Answer", "Entry", "Handler", "OwnerStats", "SessionContext"]

E = TypeVar("E", bound=events.Event)


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

    @classmethod
    def from_stream(cls, raw_id: bytes, fields: dict[bytes, bytes]) -> Entry:
        event_id = entry_id(raw_id)
        payload = fields.get(PAYLOAD_FIELD, b"")
        return cls(id=event_id, event=decode_entry(payload, event_id), payload=payload)


class Answer(NamedTuple):
    """The observation answering an entry, for the session loop to send with its next read."""

    entry: Entry
    observation: events.Observation


class SavedFold(msgspec.Struct, array_like=True):
    """A role's fold of a session's events 1..``last``, saved so that the next owner reads
    only the log after it; ``created`` is the log's creation stamp (a log made again under
    the same id is not the one folded)."""

    created: str
    last: int
    blob: bytes


class SessionContext:
    """What a handler may do for the session it serves, with the owner's fencing token.

    Made from the owner's :class:`~riverbed.bus.handles.Handles` alone: ``stopping`` ends its
    retries while Redis is unreachable, ``stats`` counts its append conflicts (both fresh when
    not given: a handler driven without an owner), ``ignores_own_answers`` is the handler's.
    """

    def __init__(
        self,
        handles: Handles,
        session: str,
        token: int,
        meta: tuple[str | None, str] | None = None,
        *,
        stopping: anyio.Event | None = None,
        stats: OwnerStats | None = None,
        ignores_own_answers: bool = False,
        owned: Owned | None = None,
    ) -> None:
        self._handles = handles
        self._owned = owned
        """The owner's record of the session (its renewals: :meth:`holds`); None, a handler
        driven without an owner."""
        self._stopping = stopping if stopping is not None else anyio.Event()
        self._stats = stats if stats is not None else OwnerStats()
        self._ignores_own_answers = ignores_own_answers
        self.session = session
        self.role = handles.role
        self.worker = handles.worker
        self.fence = Fence(handles.role, token)
        self.log = handles.log
        self.last_seen = 0
        self.delivered = 0
        """The last id this role's group delivered to this loop (set as each batch is dispatched)."""
        self.tenant: str | None = meta[0] if meta else None
        self._created_stamp: str | None = meta[1] if meta else None
        self._tenant_read = meta is not None
        self.held_writes: list[tuple[Arg, ...]] = []
        """Writes the session loop sends in the round trip of its next read (:meth:`ack_with_read`)."""

    async def answer(
        self, entry: Entry, observation: events.Observation, *, ack: bool = True, together: bool = False
    ) -> int | None:
        """Append the one observation answering ``entry`` and acknowledge the entry atomically.

        Returns its id, or None when the action was answered already (then only acks).
        ``ack=False`` leaves the entry pending: the handler is not done with it yet.
        ``together``: in one write with the answers other loops send in this turn (``bus/grouped.py``),
        and the writes held for the loop's next read go first in it.
        """
        append = self.prepare_answer(entry, observation, ack=ack)
        writes = self.take_writes() if together else []
        reply = await self._handles.answers.reply(append, writes) if together else ALONE
        if isinstance(reply, list):
            result = await append.outcome(reply)
        else:  # alone: not asked to group, a cluster, a lone answer, or a grouped write that failed for it
            self.hold_again(writes)
            # Retried until Redis answers: the one-answer guard makes a repeat of an append that did
            # go through a no-op, and giving up here would make the loop run the action again.
            result = await retry_unavailable(append.run, stopping=self._stopping)
        if not ack:
            return None if isinstance(result, AlreadyAnswered) else result[0]
        return await self.answered(entry, append, result)

    def prepare_answer(self, entry: Entry, observation: events.Observation, *, ack: bool = True) -> PreparedAppend:
        """The fenced (and, with ``ack``, acknowledging) append of ``observation`` as the answer to ``entry``."""
        changes: dict[str, Any] = {}
        if observation.cause != entry.id:
            changes["cause"] = entry.id
        if observation.tenant is None and self.tenant is not None:
            changes["tenant"] = self.tenant
        if observation.trace is None and entry.event.trace is not None:
            changes["trace"] = tracing.child_of(entry.event.trace)
        obs = self.masked(replace(observation, **changes) if changes else observation)
        return self.log.prepare(
            self.session,
            [(events.encode(obs), entry.id)],
            fence=self.fence,
            ack=(self.role, f"{entry.id}-0") if ack else None,
            pass_own=self.delivered if self._ignores_own_answers else None,
        )

    async def answered(self, entry: Entry, append: PreparedAppend, result: list[int] | AlreadyAnswered) -> int | None:
        """Finish an answer's append: the answer's id, or None (acknowledged) when one existed."""
        crashpoint("after_append")
        if isinstance(result, AlreadyAnswered):
            await self.ack([entry.id])
            return None
        self._passed(append, result)  # (so the answers to the rest of the batch move the group on too)
        return result[0]

    def _passed(self, append: PreparedAppend, ids: list[int]) -> None:
        """After ``append`` wrote ``ids``: where it moved this role's group past them (the script's
        test: the group had delivered the whole log before them), they count as delivered and seen."""
        if append.pass_own is not None and ids and ids[0] == append.pass_own + 1:
            self.delivered = ids[-1]
            self.last_seen = max(self.last_seen, ids[-1])

    async def append(
        self, batch: Sequence[events.Event], *, expected_last: int | None = None, idempotency_key: str | None = None
    ) -> list[int]:
        """Append ``batch`` with the owner's fencing token; counts an :class:`AppendConflict`.
        With ``idempotency_key``, a repeat returns the ids of the first append."""
        batch = [self.masked(event) for event in batch]
        with self._conflicts_counted():
            result = await self.log.append(
                self.session, batch, fence=self.fence, expected_last=expected_last, idempotency_key=idempotency_key
            )
        if isinstance(result, AlreadyAnswered):
            return []
        return result

    async def append_events(
        self,
        batch: Sequence[events.Event],
        *,
        expected_last: int | None = None,
        idempotency_key: str | None = None,
        pass_own: bool = False,
    ) -> list[events.Event]:
        """Append ``batch`` as :meth:`append` does; returns the events as the log now holds them
        (decoded from the payloads written, with their ids) when this call appended them, so that
        the caller can fold them without reading them back, else [] (a repeat: the log holds the
        first try's).

        ``pass_own``: the caller never needs these events delivered (it folds what it writes and
        reads the log for the rest), so when this role's group had delivered the whole log before
        them, the append moves the group past them (a read and an acknowledgement saved)."""
        pairs = [(events.encode(self.masked(event)), answered_cause(event)) for event in batch]
        prepared = self.log.prepare(
            self.session,
            pairs,
            fence=self.fence,
            expected_last=expected_last,
            idempotency_key=idempotency_key,
            ack=(self.role, "") if pass_own else None,
            pass_own=self.delivered if pass_own else None,
        )
        with self._conflicts_counted():
            result = await prepared.run()
        if isinstance(result, AlreadyAnswered) or not prepared.appended:
            return []
        self._passed(prepared, result)
        return [decode_entry(payload, event_id) for (payload, _cause), event_id in zip(pairs, result, strict=True)]

    def masked(self, event: E) -> E:
        """``event`` with the values of the tenant's secrets, and their encoded forms, replaced
        by ``[secret NAME]`` (``agent/masking.py``): everything a role appends goes through here."""
        masks = self._handles.masks
        return event if masks is None else masks.mask_event(self.tenant, event)

    async def refresh_masks(self) -> None:
        """Read the tenant's secrets again when this worker's copy is old (before a batch)."""
        if self._handles.masks is not None:
            await self._handles.masks.refresh(self.tenant)

    @contextlib.contextmanager
    def _conflicts_counted(self) -> Iterator[None]:
        """An :class:`AppendConflict` of the block is counted in the owner's stats (and raised)."""
        try:
            yield
        except AppendConflict:
            self._stats.append_conflicts += 1
            raise

    async def ack(self, ids: Sequence[int]) -> None:
        """Acknowledge ``ids``."""
        if not ids:
            return
        crashpoint("before_ack")
        handles = self._handles
        await handles.client.xack(handles.keys.log(self.session), self.role, *[f"{i}-0" for i in ids])

    def ack_with_read(self, ids: Sequence[int], *, along: Sequence[tuple[Arg, ...]] = ()) -> None:
        """Acknowledge ``ids``, and make the writes ``along`` (commands as Redis takes them), in
        the round trip of the session loop's next read rather than one of their own: that read
        follows the handler's return at once, and anything else the loop sends goes after them.

        For entries whose handling is safe to repeat: a handler that folds the log itself (the
        agent role), or entries the handler only looks at (the runtime role's, other than its
        actions): a batch delivered again because its worker stopped before that read is handled
        again and changes nothing.  The writes must be safe to make twice."""
        if ids:
            key = self._handles.keys.log(self.session)
            self.held_writes.append(("XACK", key, self.role, *[f"{i}-0" for i in ids]))
        self.held_writes.extend(along)

    def write_with_read(self, *commands: tuple[Arg, ...]) -> None:
        """Make the writes ``commands`` in the round trip of the session loop's next read, as
        :meth:`ack_with_read` does (or with :meth:`send_writes`, when the handler sends them
        before that: what it does next must see them)."""
        self.held_writes.extend(commands)

    def take_writes(self) -> list[tuple[Arg, ...]]:
        """The held writes, for the caller to send (:meth:`hold_again` those it could not)."""
        writes, self.held_writes = self.held_writes, []
        if writes:
            crashpoint("before_ack")
        return writes

    def hold_again(self, writes: list[tuple[Arg, ...]]) -> None:
        """Writes taken and not known to be made: they go first with the next read."""
        if writes:
            self.held_writes[:0] = writes

    async def send_writes(self) -> None:
        """Send the held writes now, on their own."""
        writes = self.take_writes()
        if not writes:
            return
        try:
            await self._handles.client.send(writes, raise_on_error=False)
        except BaseException:
            self.hold_again(writes)
            raise

    async def claim(self, entry: Entry, *, force: bool = False, again: Claimed | None = None) -> Claimed:
        """Claim ``entry`` with the owner's fencing token before running it (``bus/action_claims.py``);
        :class:`FencedError` when this owner's lease was taken over."""
        return await self.claim_id(entry.id, force=force, again=again)

    async def claim_id(self, action_id: int, *, force: bool = False, again: Claimed | None = None) -> Claimed:
        """:meth:`claim` by the action's id (an action this owner appended itself, never delivered)."""
        return await self._handles.claims.claim(
            self.session, action_id, self.fence, force=force, again=again, stopping=self._stopping
        )

    @property
    def released(self) -> bool:
        """Whether the session's loop gave it back (parked, retired or left), rather than lost
        it, was fenced or stopped with its worker: a handler's ``close`` may then leave slow
        work to finish after it returns."""
        return self._owned is not None and self._owned.released

    def holds_now(self) -> bool:
        """Whether :meth:`holds` is known to say yes without asking Redis (False: ask it)."""
        owned = self._owned
        return (
            owned is not None
            and not owned.lost
            and owned.token == self.fence.token
            and time.monotonic() - owned.renewed < self._handles.lease_seconds * 3 / 4
        )

    async def holds(self) -> bool:
        """Whether this worker still holds the session with this context's fencing token: work
        that costs outside the log (a model call) asks first, so an owner paused past its lease
        and resumed does not do it again for a session a peer has taken over.

        Known without a round trip while the owner's last renewal Redis confirmed (or the acquire
        that set the lease) was sent less than three quarters of a lease ago (renewals go every
        quarter: a live owner's always was): no peer takes a session before its lease ran out.
        Else one read, and a reply that took more than a quarter of the lease to come is asked
        for again: the process may have been paused while it waited (it says what held before
        the pause)."""
        if self.holds_now():
            return True
        handles = self._handles
        while True:
            asked = time.monotonic()
            held = await handles.leases.holds(self.session, self.fence.token)
            if not held or time.monotonic() - asked <= handles.lease_seconds / 4:
                return held

    async def is_answered(self, action_id: int) -> bool:
        handles = self._handles
        return await handles.client.hexists(handles.keys.answers(self.session), str(action_id))

    async def saved_fold(self) -> SavedFold | None:
        """This role's fold of the session saved by an owner before (None: none for this log)."""
        handles = self._handles
        raw = await handles.batch.hget(handles.keys.folds(self.session), self.role)
        if raw is None:
            return None
        try:
            saved = msgspec.msgpack.decode(raw, type=SavedFold)
        except msgspec.DecodeError:
            return None
        return saved if saved.created == await self.created() else None

    async def save_fold(self, last: int, blob: bytes) -> None:
        """Save this role's fold of events 1..``last`` (derived from the log: any owner's is right)."""
        handles = self._handles
        saved = SavedFold(created=await self.created(), last=last, blob=blob)
        await handles.client.hset(handles.keys.folds(self.session), self.role, msgspec.msgpack.encode(saved))

    async def created(self) -> str:
        """The log's creation stamp ('' when the session has none: Redis lost it)."""
        if self._created_stamp is None:
            self._created_stamp = (await self.log.meta(self.session)).get("created", "")
        return self._created_stamp

    async def read_tenant(self) -> None:
        """Set :attr:`tenant` from the session's meta (fixed by its first append) unless it is
        known: set by hand, or read by the acquire that made this context's owner."""
        if self.tenant is None and not self._tenant_read:
            meta = await self.log.meta(self.session)
            self.tenant = meta.get("tenant") or None
            if self._created_stamp is None:
                self._created_stamp = meta.get("created", "")
            self._tenant_read = True

    async def delivered_up_to(self) -> int:
        """The last id the log already delivered to this role's group (0: none)."""
        handles = self._handles
        for group in await handles.client.xinfo_groups(handles.keys.log(self.session)):
            if group["name"] == self.role.encode():
                return entry_id(group["last-delivered-id"])
        return 0


class Handler(Protocol):
    """A role's behaviour for the sessions it owns."""

    role: str
    ignores_own_answers: bool
    """The handler never needs its own answers delivered back (the runtime: it handles actions,
    never observations), so the append of an answer moves the role's group past it."""

    async def open(self, ctx: SessionContext) -> None:
        """Called after the session is acquired, before any entry (e.g. fold its settings)."""

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> Answer | None:
        """Entries that were in flight on a previous owner (delivered, never acknowledged);
        handled like :meth:`handle`."""

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> Answer | None:
        """New entries, in log order; acknowledge (or answer) each one, except that the answer to
        the batch's last entry may be returned instead, for the loop to send with its next read."""

    async def close(self, ctx: SessionContext) -> None:
        """Called when the session is released, parked or lost."""

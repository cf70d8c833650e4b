"""The session log: one Redis stream per session, event ids 1, 2, 3… as entry ids.

Every append goes through one Lua script (``scripts.APPEND``) that assigns the next ids
and enforces, atomically:

- ``expected_last``: optimistic concurrency (:class:`AppendConflict` when the log moved);
- an idempotency key: a retried append returns the first ids and appends nothing;
- a fencing token: a role owner whose lease was taken over cannot append (:class:`FencedError`);
- one answer per action: a second observation for the same ``cause`` is refused
  (the reply names the existing answer), so no action is ever answered twice;
- the session's tenant: the first append fixes it (no tenant is one too), and an append
  that is not a role owner's must name the same tenant (:class:`TenantMismatch`).

Reads page through ``XRANGE``; :meth:`Log.follow` tails with a bounded blocking
``XREAD`` and resumes from the last id it yielded, so it never misses or repeats an
event across reconnects.

Retention (``bus/archive.py``) moves old events to a Postgres archive and trims them from
the stream.  Every read notices when the stream does not start at the id it asked for
(or is empty where ``archived_to`` in the meta hash says events were archived) and reads
those ids from the log's :class:`ArchiveReader` first; a read whose first entry is the
id it asked for costs nothing extra.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, Unpack

import anyio
import msgspec
import redis.exceptions as rexc

from riverbed import events
from riverbed.bus import scripts
from riverbed.bus.backoff import retry_unavailable
from riverbed.bus.exchange import stream_entries
from riverbed.bus.keys import AGENT_ROLE, PAYLOAD_FIELD, ROLES, Keys, directory_entry, require_session
from riverbed.bus.redis_client import RawClient, RedisClient, StreamEntry, as_client
from riverbed.errors import (
    AlreadyAnswered,
    AppendConflict,
    ConfigError,
    FencedError,
    IdempotencyKeyReused,
    InputError,
    NotFoundError,
    TenantMismatch,
    UnavailableError,
)

__all__ = ["AlreadyAnswered", "AppendOptions", "ArchiveReader", "Fence", "Log", "PreparedAppend", "entry_id"]

IDEMPOTENCY_TTL_MS = 24 * 3600 * 1000
AUTO_IDEMPOTENCY_TTL_MS = 120 * 1000
"""How long the key of an append made without one guards against a transparent retry."""


class _AutoKeys:
    """The keys of appends made without one: a random prefix of the process's own and a count
    (a system call for each random key cost more than the rest of the key's making).  A forked
    child draws a prefix of its own, so parent and child never make the same key."""

    def __init__(self) -> None:
        self.renew()

    def renew(self) -> None:
        self.prefix = secrets.token_hex(12)
        self.count = itertools.count(1)


_auto_keys = _AutoKeys()
os.register_at_fork(after_in_child=_auto_keys.renew)


def auto_key() -> str:
    """A new key for an append made without one, unique across processes and forks."""
    return f"auto:{_auto_keys.prefix}:{next(_auto_keys.count)}"


PAGE = 2000
SESSION_KEYS_KEPT = 4096
"""Sessions whose append keys a :class:`Log` keeps made (all are made again past that many)."""
LAST_ID = 2**63 - 1
"""The largest event id a read asks for (Redis stream ids and the archive's bigint end there):
a range past it reads what the log has, not an error."""


@dataclass(frozen=True)
class Fence:
    """An owner's right to append for a role: the token it got when it took the session."""

    role: str
    token: int


class AppendOptions(TypedDict, total=False):
    """The options of an append, declared once for :meth:`Log.append`, :meth:`Log.append_raw`
    and :meth:`Log.prepare`."""

    expected_last: int | None
    """Optimistic concurrency: the append is an :class:`AppendConflict` when the log's last id is another."""
    idempotency_key: str | None
    """A retried append under the same key returns the first ids and appends nothing."""
    fence: Fence | None
    """A role owner's token: the append is a :class:`FencedError` when the lease was taken over."""
    ack: tuple[str, bytes | str] | None
    """(group, entry id): acknowledges the entry being answered in the same script (an empty
    entry id acknowledges nothing: the group is named for ``pass_own`` only)."""
    tenant: str | None
    """The session's tenant: the first append fixes it (no tenant is one too); an append that is
    not a role owner's must name the same (:class:`TenantMismatch`)."""
    pass_own: int | None
    """The last id the ``ack`` group delivered to the caller: the group also moves past what the
    append adds when that id is the log's last (nothing arrived since), for a role that never
    needs to see its own answers (or, the agent role, its own moves)."""
    digest: str | None
    """Binds ``idempotency_key`` to the request it came with (the HTTP API: a hash of the body):
    the key used again with another digest is :class:`IdempotencyKeyReused`."""


class ArchiveReader(Protocol):
    """Where events trimmed from a stream are read from (``bus.archive.Archive``)."""

    def read(self, session: str, start: int, end: int) -> AsyncIterator[tuple[int, bytes]]: ...


class Pages(Protocol):
    """Where a log's reads page from: the client, or a worker's ``bus.grouped.Batched``."""

    async def xrange(self, key: str, min: str = "-", max: str = "+", count: int | None = None) -> list[StreamEntry]: ...


def entry_id(raw: bytes | str) -> int:
    """Event id of a stream entry id (``b"12-0"`` -> 12)."""
    if isinstance(raw, bytes):
        return int(raw.partition(b"-")[0])
    return int(raw.partition("-")[0])


_RUN_KINDS = tuple(
    b"\xa4kind" + msgspec.msgpack.encode(events.kind_of(cls))
    for cls in (events.RunStarted, events.RunCancel, events.Approval, events.RunResumed, events.RunUpgraded)
)
"""What a client appends that the agent role must see even while it let the session go: a run
opens, is cancelled, is approved on, resumed or upgraded."""
_RUN_KIND_MARKS = re.compile(b"|".join(re.escape(mark) for mark in _RUN_KINDS))


def wakes_agent(payload: bytes) -> bool:
    """Whether an event's payload is one of :data:`_RUN_KINDS` (the agent role is announced for it).

    An event's msgpack form starts with its ``kind`` (the union's tag is encoded first), so a
    look at its first bytes tells, without decoding it."""
    return _RUN_KIND_MARKS.search(payload, 0, 24) is not None


def payload_kind(payload: bytes) -> str | None:
    """The ``kind`` an encoded event starts with (None: it does not start with one)."""
    first = payload[:1]
    start = 1 if first and 0x80 <= first[0] <= 0x8F else 3 if first == b"\xde" else 5 if first == b"\xdf" else -1
    if start < 0 or payload[start : start + 5] != b"\xa4kind" or len(payload) < start + 6:
        return None
    head = payload[start + 5]
    if 0xA0 <= head <= 0xBF:
        begin, size = start + 6, head & 0x1F
    elif head == 0xD9 and len(payload) > start + 6:
        begin, size = start + 7, payload[start + 6]
    else:
        return None
    return payload[begin : begin + size].decode("utf-8", "replace")


def wakes_runtime(payload: bytes) -> bool:
    """Whether an appended event is work for the runtime role, which is announced only for it:
    an action it runs, a person's approval (of an action waiting for one), a fork whose sandbox
    it rebuilds, or an event of a kind this version cannot decode (the runtime answers those
    with an error: :func:`~riverbed.events.for_runtime`).  Most kinds are told by their name;
    the few whose role depends on the call (``tool_call``, ``mcp_list``: ``runs_in``),
    approvals, forks and unknown ones are decoded."""
    kind = payload_kind(payload)
    cls = events.class_of(kind) if kind is not None else None
    if cls is None:
        return True
    if issubclass(cls, events.Action) and cls.answering_role is events.Action.answering_role:
        return cls.answered_by == "runtime"
    if not issubclass(cls, events.Action | events.Approval | events.Forked | events.Unknown):
        return False
    event = events.decode(payload)
    if isinstance(event, events.Forked):
        return event.workspace != "empty"  # the runtime rebuilds the fork's sandbox (or says why not)
    if isinstance(event, events.Approval):
        return event.source == "user" and event.decision == "approve"
    return events.for_runtime(event)


RINGS_RUNTIME = frozenset({"run_cancel"})
"""Kinds that are no work for the runtime role (they never announce a session to it) but that its
owning loop hears of at once all the same: a cancel stops the session's background commands."""


def answered_cause(event: events.Event) -> int:
    """The action id this event answers (0: it answers nothing)."""
    if isinstance(event, events.Observation) and event.cause is not None:
        return event.cause
    return 0


class PreparedAppend:
    """One APPEND script call, built once: run it alone (:meth:`run`) or send :attr:`command`
    in an :func:`~riverbed.bus.exchange.exchange` and hand the reply to :meth:`outcome`.

    Running it again after a broken connection is safe: its idempotency key makes a repeat of
    an append that went through return the same ids (an owner's answers have none: a repeat is
    refused as answered).
    """

    def __init__(
        self,
        log: Log,
        session: str,
        keys: list[str],
        args: list[Any],
        expected_last: int | None,
        fence: Fence | None,
        tenant: str | None = None,
        pass_own: int | None = None,
    ) -> None:
        self.log = log
        self.session = session
        self.tenant = tenant
        self.pass_own = pass_own
        """The last id the caller's group had delivered, when the append may move it past the
        events appended (``AppendOptions.pass_own``)."""
        self.keys = keys
        self.args = args
        self.expected_last = expected_last
        self.fence = fence
        self.appended = False
        """Whether a reply said this call appended (not a repeat, a conflict or a refusal)."""

    @property
    def command(self) -> tuple[Any, ...]:
        return ("EVALSHA", self.log.append_script.sha, len(self.keys), *self.keys, *self.args)

    async def run(self) -> list[int] | AlreadyAnswered:
        """Run the call alone: in an exchange of one command where the client offers that (a
        sixth less CPU than the client library's command path, its retry wrapper and reply
        callbacks), else, or after ``NOSCRIPT`` or a broken connection, as the library's script
        call, which loads the script and retries (a repeat is safe: see the class)."""
        script = self.log.append_script
        try:
            await script.load()
            async with self.log.redis.exchange(self.command) as replies:
                reply = None if replies is None else await replies.read()
        except (rexc.NoScriptError, UnavailableError):
            reply = None
        if reply is None:  # (never the script's reply: that is always a list)
            reply = await script(self.keys, self.args)
        return await self.outcome(reply)

    async def outcome(self, reply: list[Any]) -> list[int] | AlreadyAnswered:
        """The ids a reply names (announcing the session where the script says so)."""
        status = reply[0]
        if status in (b"ok", b"dup"):
            self.appended = status == b"ok"
            first, count, index = int(reply[1]), int(reply[2]), int(reply[3])
            need = [r.decode() for r in reply[4:]]
            if need or index:
                await self.log.announce(self.session, need, created=bool(index), tenant=self.tenant)
            return list(range(first, first + count))
        if status == b"conflict":
            raise AppendConflict(self.session, self.expected_last or 0, int(reply[1]))
        if status == b"fenced":
            assert self.fence is not None
            raise FencedError(self.session, self.fence.role, self.fence.token, int(reply[1]))
        if status == b"answered":
            return AlreadyAnswered(cause=int(reply[1]), existing=int(reply[2]))
        if status == b"tenant":
            raise TenantMismatch(self.session, self.tenant)
        if status == b"reused":
            raise IdempotencyKeyReused(self.session, int(reply[1]))
        raise RuntimeError(f"unexpected append reply {reply!r}")


class Log:
    """Appends and reads of session logs under one key prefix."""

    def __init__(
        self,
        redis: RedisClient | RawClient,
        keys: Keys,
        url: str = "redis",
        *,
        archive: ArchiveReader | None = None,
        batch: Pages | None = None,
    ) -> None:
        self.redis = as_client(redis, url)
        self.keys = keys
        self.archive = archive
        self._pages: Pages = batch or self.redis
        """Where reads page from: a worker's ``Batched``, so that the sessions it takes at
        once read their logs in one write."""
        self.append_script = self.redis.script(scripts.APPEND)
        self._sandbox_user = self.redis.script(scripts.SANDBOX_USER)
        self._announce_keys: tuple[str, ...] = (
            ()
            if self.redis.cluster
            else (*(keys.directory(role) for role in ROLES), keys.sessions, keys.directory(AGENT_ROLE))
        )
        """The directories and the sessions index, which the append script reaches on a standalone
        Redis (none on a cluster: they are in other slots, and the caller announces)."""
        self._session_keys: dict[str, tuple[str, str, str, str, str]] = {}

    def check_session(self, session: str) -> None:
        require_session(session)

    def _keys_of(self, session: str) -> tuple[str, str, str, str, str]:
        """The keys of a valid ``session`` that every append names (log, meta, answers, claims,
        wake-up channel), made once: a worker appends to the same few sessions again and again."""
        self.check_session(session)
        if len(self._session_keys) >= SESSION_KEYS_KEPT:
            self._session_keys.clear()
        keys = self.keys
        made = (keys.log(session), keys.meta(session), keys.answers(session), keys.claims(session), keys.wake(session))
        self._session_keys[session] = made
        return made

    async def append(
        self, session: str, batch: Sequence[events.Event], **options: Unpack[AppendOptions]
    ) -> list[int] | AlreadyAnswered:
        """Append ``batch`` in one round trip; returns the new ids (or the first ids on a retry)."""
        return await self.append_raw(session, [(events.encode(e), answered_cause(e)) for e in batch], **options)

    async def append_raw(
        self, session: str, batch: Sequence[tuple[bytes, int]], **options: Unpack[AppendOptions]
    ) -> list[int] | AlreadyAnswered:
        """Append (payload, answered cause) pairs, as :meth:`append` does events."""
        if not batch:
            self.check_session(session)
            return []
        return await self.prepare(session, batch, **options).run()

    def prepare(
        self,
        session: str,
        batch: Sequence[tuple[bytes, int]],
        *,
        expected_last: int | None = None,
        idempotency_key: str | None = None,
        fence: Fence | None = None,
        ack: tuple[str, bytes | str] | None = None,
        tenant: str | None = None,
        pass_own: int | None = None,
        digest: str | None = None,
    ) -> PreparedAppend:
        """An append of (payload, answered cause) pairs, ready to run alone or in an exchange
        (:class:`AppendOptions` says what each option does)."""
        session_keys = self._session_keys.get(session)
        if session_keys is None:
            session_keys = self._keys_of(session)
        if idempotency_key is not None and not (0 < len(idempotency_key) <= 200):
            raise InputError("an idempotency key must be 1 to 200 characters long")
        ttl: int | str = IDEMPOTENCY_TTL_MS
        if idempotency_key is None:
            if fence is not None and all(cause for _payload, cause in batch) and not self.redis.cluster:
                # An owner's answers need no key: a repeat of one that went through is refused as
                # answered (the owner then only acknowledges), and on a standalone Redis the
                # script announced the session in the same step, so the lost reply lost nothing.
                idempotency_key, ttl = "-", ""
            else:
                # Every other call gets a key of its own, kept briefly: the client retries a command
                # whose connection broke, and a retry of an append that went through must not
                # append twice.
                idempotency_key = auto_key()
                ttl = AUTO_IDEMPOTENCY_TTL_MS
        args: list[Any] = [
            "" if expected_last is None else expected_last,
            ttl,
            "" if fence is None else fence.role,
            0 if fence is None else fence.token,
            "" if ack is None else ack[0],
            "" if ack is None else ack[1],
            tenant or "",
            len(batch),
            "" if pass_own is None else pass_own,
            session,
            digest or "",
        ]
        wake_agent = wake_runtime = ring_runtime = False
        for payload, cause in batch:
            args.append(payload)
            args.append(cause)
            if not cause:  # (an answer is never a run's event nor runtime work: no look at it)
                wake_agent = wake_agent or wakes_agent(payload)
                wake_runtime = wake_runtime or wakes_runtime(payload)
                ring_runtime = ring_runtime or payload_kind(payload) in RINGS_RUNTIME
        args.append("1" if wake_agent else "")
        args.append("1" if wake_runtime else "r" if ring_runtime else "")
        keys = self.keys
        log_key, meta_key, answers_key, claims_key, wake_key = session_keys
        script_keys = [log_key, meta_key, answers_key, keys.idem(session, idempotency_key), claims_key, wake_key]
        if self._announce_keys:
            # Keys of other slots: on a standalone Redis the script announces the session itself.
            script_keys += self._announce_keys
            if tenant:
                script_keys.append(keys.tenant_sessions(tenant))
        passes = pass_own if ack is not None else None  # (the script moves only a group it names)
        return PreparedAppend(self, session, script_keys, args, expected_last, fence, tenant, passes)

    async def append_then_read(
        self, session: str, batch: Sequence[tuple[bytes, int]], *, block_ms: int, tenant: str | None = None
    ) -> tuple[list[int], list[tuple[int, bytes]]]:
        """Append ``batch`` ((payload, answered cause) pairs of actions) and, in the same round
        trip, wait up to ``block_ms`` for the first entries after it: (new ids, (id, payload) pairs).

        The pairs can miss entries that follow the append (after a broken connection, or on a
        cluster, where the two commands go one by one): callers tail from the ids to be sure.
        """
        prepared = self.prepare(session, batch, tenant=tenant)
        read = ("XREAD", "COUNT", PAGE, "BLOCK", block_ms, "STREAMS", self.keys.log(session), "$")
        try:
            await self.append_script.load()
            async with self.redis.exchange(prepared.command, read) as replies:
                if replies is not None:
                    ids = await prepared.outcome(await replies.read())
                    assert not isinstance(ids, AlreadyAnswered)  # an action answers nothing
                    if not prepared.appended:
                        return ids, []
                    entries = stream_entries(await replies.read())
                    return ids, [(entry_id(i), fields.get(PAYLOAD_FIELD, b"")) for i, fields in entries]
        except (rexc.NoScriptError, UnavailableError):
            pass  # run alone below: that loads the script, or retries under the same idempotency key
        ids = await prepared.run()
        assert not isinstance(ids, AlreadyAnswered)
        return ids, []

    async def announce(self, session: str, roles: Sequence[str], *, created: bool, tenant: str | None = None) -> None:
        """Tell role workers that ``session`` needs an owner (the ownership scripts clear the flag);
        ``created``: add it to the sessions index (and to its ``tenant``'s)."""
        async with self.redis.pipeline() as pipe:
            entry = directory_entry(session, tenant)
            for role in roles:
                pipe.xadd(self.keys.directory(role), entry)
            if created:
                pipe.zadd(self.keys.sessions, {session: time.time()}, nx=True)
                if tenant:
                    pipe.zadd(self.keys.tenant_sessions(tenant), {session: time.time()}, nx=True)
            await pipe.execute()

    async def last_id(self, session: str) -> int:
        value = await self.redis.hget(self.keys.meta(session), "last")
        return int(value or 0)

    async def meta(self, session: str) -> dict[str, str]:
        raw = await self.redis.hgetall(self.keys.meta(session))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def exists(self, session: str) -> bool:
        return await self.last_id(session) > 0

    async def sandbox_user(self, session: str) -> int:
        """The number of the session's sandbox user (1, 2, 3…): unique under this prefix, taken
        from a counter the first time and kept in the session's meta, so that every owner of the
        session (a takeover too) runs its sandbox as the same user, and no two sessions share one
        (a user's process limit is the kernel's count of that user's processes).  A Redis that
        lost its data starts the count over; the sessions that held those numbers lost their
        logs too, and their owners close their sandboxes when their leases fail."""
        meta = self.keys.meta(session)
        if not self.redis.cluster:  # one round trip: the counter is in the script's reach
            return abs(int(await self._sandbox_user(keys=[meta, self.keys.uids], args=[""])))
        held = await self.redis.hget(meta, "uid")
        if held is not None:
            return int(held)
        number = await self.redis.incr(self.keys.uids)
        return abs(int(await self._sandbox_user(keys=[meta], args=[number])))

    async def read_raw(
        self, session: str, start: int = 1, end: int | None = None, *, page: int = PAGE
    ) -> AsyncIterator[tuple[int, bytes]]:
        """(id, payload) pairs of events start..end (inclusive), page by page, archive included."""
        async for chunk in self._chunks(session, start, end, page):
            if isinstance(chunk, list):
                for raw_id, fields in chunk:
                    yield entry_id(raw_id), fields.get(PAYLOAD_FIELD, b"")
            else:
                async for pair in chunk:
                    yield pair

    async def read(self, session: str, start: int = 1, end: int | None = None) -> AsyncIterator[events.Event]:
        """Events start..end, archive included; an entry that cannot be decoded at all is
        yielded as ``Unknown``."""
        decode = events.decode
        async for chunk in self._chunks(session, start, end, PAGE):
            if isinstance(chunk, list):
                # Replays are the hot path: the entries of a page are decoded in this loop.
                for raw_id, fields in chunk:
                    event_id = int(raw_id.partition(b"-")[0])
                    payload = fields.get(PAYLOAD_FIELD, b"")
                    try:
                        event = decode(payload, event_id)
                    except events.DecodeError:
                        event = decode_entry(payload, event_id)
                    yield event
            else:
                async for event_id, payload in chunk:
                    yield decode_entry(payload, event_id)

    async def _chunks(
        self, session: str, start: int, end: int | None, page: int
    ) -> AsyncIterator[list[StreamEntry] | AsyncIterator[tuple[int, bytes]]]:
        """Events start..end in order: the stream's pages of entries and, where the stream was
        trimmed, the archive's runs of (id, payload) pairs (each run to be read before the next
        chunk is asked for)."""
        key = self.keys.log(session)
        want = max(start, 1)
        if want > LAST_ID:
            return
        end = None if end is None or end >= LAST_ID else end
        hi = "+" if end is None else f"{end}-0"
        while end is None or want <= end:
            entries = await self._pages.xrange(key, f"{want}-0", hi, count=page)
            if not entries or entry_id(entries[0][0]) != want:
                upto = await self._archived_upto(session, want, end, entries)
                if upto < want:
                    return
                yield self._read_archive(session, want, upto)
                want = upto + 1
                if not entries:
                    continue
            yield entries
            if len(entries) < page:
                return
            want = entry_id(entries[-1][0]) + 1

    async def _archived_upto(self, session: str, want: int, end: int | None, entries: list[StreamEntry]) -> int:
        """The last id of the run of archived events that starts at ``want`` (< ``want``: none).

        The stream's first entry after ``want`` bounds the run; with no entry at all, the
        ``archived_to`` mark of the meta hash does (one HGET, only on this slow path).
        """
        if entries:
            return entry_id(entries[0][0]) - 1
        raw = await self.redis.hget(self.keys.meta(session), "archived_to")
        upto = int(raw or 0)
        return upto if end is None else min(upto, end)

    async def _read_archive(self, session: str, start: int, end: int) -> AsyncIterator[tuple[int, bytes]]:
        """Events start..end from the archive; every one of them must be there."""
        if self.archive is None:
            raise ConfigError(
                f"events {start}..{end} of session {session!r} were moved to the Postgres archive: "
                "set RIVERBED_DATABASE_URL to read them"
            )
        expected = start
        async for event_id, payload in self.archive.read(session, start, end):
            if event_id != expected:
                break
            yield event_id, payload
            expected += 1
        if expected != end + 1:
            raise NotFoundError(
                f"event {expected} of session {session!r} is neither in its Redis stream nor in the archive"
            )

    async def follow(
        self, session: str, start: int = 1, *, block_ms: int = 1000, stop: anyio.Event | None = None
    ) -> AsyncIterator[events.Event]:
        """Events from ``start`` on, then new ones as they arrive, until ``stop`` is set."""
        next_id = min(max(start, 1), LAST_ID)
        key = self.keys.log(session)

        async def read() -> list[StreamEntry]:
            return await self.redis.xread(key, f"{next_id - 1}-0", count=PAGE, block=block_ms)

        while stop is None or not stop.is_set():
            try:
                entries = await retry_unavailable(
                    read, stopping=stop, first=0.05, what="follow.reconnecting", session=session
                )
            except UnavailableError:
                return  # Redis is unreachable and ``stop`` is set
            if entries and entry_id(entries[0][0]) > next_id:
                async for event_id, payload in self._read_archive(session, next_id, entry_id(entries[0][0]) - 1):
                    next_id = event_id + 1
                    yield decode_entry(payload, event_id)
            for raw_id, fields in entries:
                event_id = entry_id(raw_id)
                next_id = event_id + 1
                yield decode_entry(fields.get(PAYLOAD_FIELD, b""), event_id)


def decode_entry(payload: bytes, event_id: int) -> events.Event:
    """Decode a stream entry; bytes that are not an event at all become ``Unknown`` (kept raw)."""
    try:
        return events.decode(payload, event_id)
    except events.DecodeError as exc:
        return events.Unknown(id=event_id, original_kind="", payload={"undecodable": payload.hex(), "error": str(exc)})

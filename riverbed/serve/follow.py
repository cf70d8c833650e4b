"""Followers: one reader per followed session on a server, fanning out to every event stream.

An event stream holds no Redis connection while it waits, however many are open.  The server
subscribes once to each followed session's wake-up channel (``bus/wakeups.py``: one subscribed
connection per Redis node for the whole server); when a session's bell rings, its one reader
reads what is new (a non-blocking ``XREAD`` on the shared pool) and hands each event's SSE
frame to every stream of the session.

A stream joins, then reads what it missed itself (paged ``XRANGE``, at most
:data:`CATCH_UPS` streams at once), then takes the reader's frames, skipping those it read.
A stream too slow for its buffer is dropped from the fan-out and reads its way back the same
way, so one slow client never holds the others up; a gap in the ids (events the archive
took meanwhile) is read from the log too.  A log deleted and created again under the same id
(its meta ``created`` changed: it may be another tenant's now) ends its streams.

Pub/Sub delivers at most once: a feed that reconnects rings every bell, and a reader that
hears nothing reads every :data:`POLL_SECONDS` anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream, TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from riverbed import events
from riverbed.bus.keys import PAYLOAD_FIELD
from riverbed.bus.log import PAGE, Log, decode_entry, entry_id
from riverbed.bus.redis_client import RedisClient
from riverbed.bus.wakeups import Wakeups
from riverbed.errors import RiverbedError

__all__ = ["Followers", "Frame", "frame"]

log = structlog.get_logger("riverbed.serve")

Frame = tuple[int, bytes]
"""An event's id and its SSE message."""

BUFFER = 256
"""Frames a stream may fall behind the reader before it is dropped to read its own way back."""
CATCH_UPS = 16
"""Streams reading what they missed at once (each read takes a pooled connection briefly)."""
POLL_SECONDS = 5.0
"""A reader that heard no wake-up reads after this long anyway (a wake-up lost to a reconnect)."""
RETRY_SECONDS = 1.0
"""A stream whose reader failed (Redis away) joins a new one after this long."""
ROLE = "serve"


def frame(event: events.Event) -> Frame:
    """One SSE message for an event."""
    event_id = event.id or 0
    return event_id, b"id: %d\ndata: %s\n\n" % (event_id, events.encode_json(event))


@dataclass(eq=False)
class _Tail:
    """The reader of one followed session and the streams it feeds."""

    session: str
    streams: set[MemoryObjectSendStream[Frame]] = field(default_factory=set)
    cursor: int = 0
    ready: anyio.Event = field(default_factory=anyio.Event)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    failed: BaseException | None = None
    created: bytes | None = None
    """The log's creation stamp when the reader started (meta ``created``)."""
    gone: bool = False
    """The log was deleted or created again under the same id: its streams end."""


class Followers:
    """The followed sessions of one server; :meth:`run` must be running."""

    def __init__(self, log_store: Log, redis: RedisClient) -> None:
        self.log = log_store
        self.redis = redis
        self.wakeups = Wakeups(redis.raw, log_store.keys)
        self._tails: dict[str, _Tail] = {}
        self._catch_ups = anyio.CapacityLimiter(CATCH_UPS)
        self._tg: TaskGroup | None = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self.wakeups.run)
            self._tg = tg
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None

    async def follow(self, session: str, start: int, until: int | None, tx: ObjectSendStream[Frame]) -> None:
        """Send the frames of ``session``'s events ``start``..``until`` (None: on and on) to ``tx``."""
        seen = start - 1
        async with tx:
            created = await self._created(session)  # the log the request was allowed to read
            if until is not None:  # a log that holds ``until`` already needs no reader
                seen = await self._catch_up(session, seen, until, tx)
            while until is None or seen < until:
                inbox_tx, inbox = anyio.create_memory_object_stream[Frame](BUFFER)
                with inbox_tx, inbox:  # closed also when joining fails or is cancelled
                    tail = await self._join(session, inbox_tx)
                    try:
                        if tail.created != created or tail.gone:
                            return  # another log under the same id now: it may be another tenant's
                        seen = await self._catch_up(session, seen, until, tx)
                        if until is None or seen < until:
                            seen = await self._live(session, seen, until, inbox, tx)
                    finally:
                        self._leave(tail, inbox_tx)
                if tail.gone:
                    return
                if tail.failed is not None:
                    await anyio.sleep(RETRY_SECONDS)  # (the reader said why) then a new reader tries

    async def _live(
        self, session: str, seen: int, until: int | None, inbox: ObjectReceiveStream[Frame], tx: ObjectSendStream[Frame]
    ) -> int:
        """Frames from the reader after ``seen``, until ``until`` or the reader drops this stream."""
        async for event_id, message in inbox:
            if event_id <= seen:
                continue
            if event_id > seen + 1:  # a gap: read it from the log (the archive, a lost batch)
                seen = await self._catch_up(
                    session, seen, event_id - 1 if until is None else min(event_id - 1, until), tx
                )
            if until is not None and event_id > until:
                break
            await tx.send((event_id, message))
            seen = event_id
            if until is not None and seen >= until:
                break
        return seen

    async def _catch_up(self, session: str, seen: int, upto: int | None, tx: ObjectSendStream[Frame]) -> int:
        """Read the events after ``seen`` (to ``upto``, else to the end of the log) and send them."""
        while upto is None or seen < upto:
            last = seen + PAGE if upto is None else min(upto, seen + PAGE)
            async with self._catch_ups:
                page = [frame(e) async for e in self.log.read(session, seen + 1, last)]
            for item in page:
                await tx.send(item)
                seen = item[0]
            if len(page) < PAGE:
                break
        return seen

    async def _join(self, session: str, inbox: MemoryObjectSendStream[Frame]) -> _Tail:
        tail = self._tails.get(session)
        if tail is None:
            if self._tg is None:
                raise RiverbedError("the server is not following sessions (Followers.run is not running)")
            tail = self._tails[session] = _Tail(session)
            self._tg.start_soon(self._read, tail)
        tail.streams.add(inbox)
        try:
            await tail.ready.wait()
        except BaseException:
            self._leave(tail, inbox)
            raise
        return tail

    def _leave(self, tail: _Tail, inbox: MemoryObjectSendStream[Frame]) -> None:
        tail.streams.discard(inbox)
        inbox.close()
        if not tail.streams:
            tail.scope.cancel()
            if self._tails.get(tail.session) is tail:
                del self._tails[tail.session]

    async def _read(self, tail: _Tail) -> None:
        """The session's one reader: on each wake-up, read what is new and fan it out."""
        with tail.scope:
            try:
                bell = await self.wakeups.watch(tail.session, ROLE)
            except Exception as exc:  # the streams hear it; the next one to join tries again
                self._fail(tail, exc)
                return
            try:
                key = self.log.keys.log(tail.session)
                mark = bell.rung  # (before the cursor: an append after it rings after the mark)
                tail.created = await self._created(tail.session)
                tail.cursor = await self.log.last_id(tail.session)
                tail.ready.set()
                more = False
                while True:
                    if not more:
                        rang = await bell.wait(mark, POLL_SECONDS)
                        mark = bell.rung
                        if rang and bell.news is not None and bell.news <= tail.cursor:
                            continue
                    entries = await self.redis.xread(key, f"{tail.cursor}-0", count=PAGE)
                    # Entries to hand out: from the log the streams were allowed to read? (Asked after
                    # the read: a stamp unchanged then was unchanged when the entries were read.)
                    if entries and await self._created(tail.session) != tail.created:
                        self._end(tail, failed=None)
                        return
                    more = len(entries) == PAGE
                    for raw_id, fields in entries:
                        item = frame(decode_entry(fields.get(PAYLOAD_FIELD, b""), entry_id(raw_id)))
                        tail.cursor = item[0]
                        for inbox in list(tail.streams):
                            try:
                                inbox.send_nowait(item)
                            except anyio.WouldBlock:  # too slow: it reads its own way back
                                tail.streams.discard(inbox)
                                inbox.close()
            except Exception as exc:
                self._fail(tail, exc)
            finally:
                with anyio.CancelScope(shield=True):
                    await self.wakeups.unwatch(tail.session, bell)

    async def _created(self, session: str) -> bytes | None:
        return await self.redis.hget(self.log.keys.meta(session), "created")

    def _fail(self, tail: _Tail, exc: BaseException) -> None:
        log.warning("serve.follow_failed", session=tail.session, error=str(exc))
        self._end(tail, failed=exc)

    def _end(self, tail: _Tail, *, failed: BaseException | None) -> None:
        """Close every stream of ``tail``: after a failure they join a new reader, after the
        log went (``failed`` None) they end."""
        tail.failed = failed
        tail.gone = failed is None
        tail.ready.set()
        for inbox in list(tail.streams):
            inbox.close()
        tail.streams.clear()
        if self._tails.get(tail.session) is tail:
            del self._tails[tail.session]

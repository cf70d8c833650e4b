"""Retention: old events move from the Redis stream to a Postgres archive table.

A retention pass over one session (:func:`retain`):

1. finds the **safe point**: the highest event id that every role's consumer group on the log
   has been delivered (``last-delivered-id``) and that is below the first entry any group
   still has pending (``XPENDING`` summary); a role whose group does not exist yet has not
   seen the session at all, so nothing is trimmed (but for the runtime role when the session
   never had work for it: it folds the log from the archive up if it ever takes the session);
   at least ``keep_last`` events stay;
2. walks the stream from its first entry up to the safe point and stops at the first event
   younger than ``older_than_seconds`` (the event's ``ts``);
3. copies those events, page by page, into ``<schema>.log_archive`` in one transaction per
   page (``ON CONFLICT DO NOTHING``) and checks that every one of them is there, byte for
   byte; only then trims the stream exactly (``XTRIM MINID``) and records ``archived_to``
   in the session's meta hash, both in one Lua script.

A pass killed between the copy and the trim leaves the events in both places; the next
pass copies nothing new and trims.  Reads span the archive and the stream transparently
(:class:`riverbed.bus.log.Log` asks an :class:`Archive` for ids below the stream's first).

Table (``<s>`` is the schema named after the prefix, shared with the memory store)::

    <s>.log_archive (session text, event_id bigint, payload bytea,
                     archived_at timestamptz, PRIMARY KEY (session, event_id))
"""

# ruff: noqa: S608  (SQL text only interpolates the validated, quoted schema name)
from __future__ import annotations

import contextlib
import datetime as dt
import math
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Unpack

import anyio
import asyncpg
import msgspec
import redis.exceptions as rexc
import structlog
from anyio.abc import TaskStatus
from asyncpg.pool import PoolConnectionProxy

from riverbed.bus import scripts
from riverbed.bus.connection import redact
from riverbed.bus.keys import ON_DEMAND, PAYLOAD_FIELD, ROLES, Keys
from riverbed.bus.log import PAGE, entry_id
from riverbed.bus.redis_client import RawClient, RedisClient, as_client
from riverbed.errors import InputError, RiverbedError, UnavailableError
from riverbed.pg import LazyPool, PoolOptions, check_schema, migrate

__all__ = ["Archive", "Retention", "first_stream_id", "retain", "safe_point"]

log = structlog.get_logger("riverbed.retention")

#: The advisory lock key of the memory store's migrations: both create the same schema, and
#: two concurrent ``CREATE SCHEMA IF NOT EXISTS`` may otherwise fail on each other.


MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE {s}.log_archive (
            session     text        NOT NULL,
            event_id    bigint      NOT NULL,
            payload     bytea       NOT NULL,
            archived_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (session, event_id)
        );
        """,
    ),
]


class Archive:
    """The archive table over a small asyncpg pool.  The constructor does no I/O; the pool
    is opened (and the table created) by the first call that needs it."""

    def __init__(self, url: str, *, schema: str = "rb", **pool: Unpack[PoolOptions]) -> None:
        self.url = url
        self.schema = schema
        self._s = check_schema(schema)
        # The archive's own defaults: a small pool, and time for a copy of a whole batch.
        pool.setdefault("max_size", 4)
        pool.setdefault("command_timeout", 60.0)
        self._pg = LazyPool(url, what=f"log archive in Postgres at {redact(url)}", prepare=self._migrate, **pool)

    @property
    def started(self) -> bool:
        return self._pg.started

    async def start(self) -> None:
        """Connect and create the table if missing (safe when several processes start at once)."""
        await self._pg.start()

    async def _migrate(self, conn: asyncpg.Connection[asyncpg.Record]) -> None:
        await migrate(conn, self.schema, table="archive_migrations", migrations=MIGRATIONS)

    async def close(self) -> None:
        await self._pg.close()

    @contextlib.asynccontextmanager
    async def _conn(self) -> AsyncIterator[PoolConnectionProxy[asyncpg.Record]]:
        await self.start()
        async with self._pg.connection() as conn:
            yield conn

    async def copy(self, session: str, rows: Sequence[tuple[int, bytes]]) -> int:
        """Store ``rows`` (event id, payload) in one transaction; rows already archived are kept.

        Raises :class:`RiverbedError` (and commits nothing new) unless afterwards every row is
        in the archive with exactly these bytes; returns how many rows were new.
        """
        if not rows:
            return 0
        ids = [event_id for event_id, _ in rows]
        payloads = [payload for _, payload in rows]
        async with self._conn() as conn, conn.transaction():
            status = await conn.execute(
                f"INSERT INTO {self._s}.log_archive (session, event_id, payload) "
                "SELECT $1, i, p FROM unnest($2::bigint[], $3::bytea[]) AS u(i, p) "
                "ON CONFLICT (session, event_id) DO NOTHING",
                session,
                ids,
                payloads,
            )
            same = await conn.fetchval(
                f"SELECT count(*) FROM {self._s}.log_archive a "
                "JOIN unnest($2::bigint[], $3::bytea[]) AS u(i, p) ON a.event_id = u.i AND a.payload = u.p "
                "WHERE a.session = $1",
                session,
                ids,
                payloads,
            )
            if same != len(rows):
                raise RiverbedError(
                    f"the archive of session {session!r} holds other bytes for some of events "
                    f"{ids[0]}..{ids[-1]} ({same} of {len(rows)} match); nothing was trimmed"
                )
        return int(status.rsplit(" ", 1)[-1])

    async def read(self, session: str, start: int, end: int) -> AsyncIterator[tuple[int, bytes]]:
        """(id, payload) of the archived events start..end (inclusive), in order, page by page
        (no connection is held while the caller consumes a page)."""
        lo = start
        while lo <= end:
            async with self._conn() as conn:
                rows = await conn.fetch(
                    f"SELECT event_id, payload FROM {self._s}.log_archive "
                    "WHERE session = $1 AND event_id BETWEEN $2 AND $3 ORDER BY event_id LIMIT $4",
                    session,
                    lo,
                    end,
                    PAGE,
                )
            for row in rows:
                yield int(row["event_id"]), bytes(row["payload"])
            if len(rows) < PAGE:
                return
            lo = int(rows[-1]["event_id"]) + 1

    async def count(self, session: str, start: int = 1, end: int | None = None) -> int:
        async with self._conn() as conn:
            value = await conn.fetchval(
                f"SELECT count(*) FROM {self._s}.log_archive WHERE session = $1 AND event_id BETWEEN $2 AND $3",
                session,
                start,
                end if end is not None else 2**63 - 1,
            )
        return int(value)

    async def last_id(self, session: str) -> int:
        """The highest archived event id of ``session`` (0: none)."""
        async with self._conn() as conn:
            value = await conn.fetchval(f"SELECT max(event_id) FROM {self._s}.log_archive WHERE session = $1", session)
        return int(value or 0)


# --- the retention pass ----------------------------------------------------------------------


class _Stamp(msgspec.Struct):
    ts: dt.datetime | None = None


_stamp = msgspec.msgpack.Decoder(_Stamp)


def _event_time(payload: bytes) -> dt.datetime | None:
    """The ``ts`` of a payload, without decoding the whole event (None when it has none)."""
    try:
        ts = _stamp.decode(payload).ts
    except msgspec.DecodeError:
        return None
    if ts is not None and ts.tzinfo is None:
        ts = ts.replace(tzinfo=dt.UTC)
    return ts


async def first_stream_id(redis: RedisClient | RawClient, keys: Keys, session: str, *, url: str = "redis") -> int:
    """The id of the first event still in the Redis stream (0: the stream is empty)."""
    entries = await as_client(redis, url).xrange(keys.log(session), "-", "+", count=1)
    return entry_id(entries[0][0]) if entries else 0


async def safe_point(
    redis: RedisClient | RawClient, keys: Keys, session: str, *, keep_last: int, url: str = "redis"
) -> int:
    """The highest event id every role has finished with and that leaves ``keep_last`` events
    in the stream (0: nothing may be trimmed).

    A role has finished with an event when its group was delivered it and nothing at or
    before it is pending in the group.  A missing group means the role never saw the
    session: then nothing may be trimmed, unless the role is announced only for its work
    (:data:`~riverbed.bus.keys.ON_DEMAND`) and never was for this session.
    """
    client = as_client(redis, url)
    key = keys.log(session)
    try:
        groups = {g["name"].decode(): g for g in await client.xinfo_groups(key)}
    except rexc.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return 0
        raise
    missing = [role for role in ROLES if role not in groups]
    if any(role not in ON_DEMAND for role in missing):
        return 0
    if missing:
        # A role announced only for its work that never had any here has nothing to finish
        # (when it takes the session, it folds the log from the archive up); one announced or
        # held once has.
        marks = await client.hmget(keys.meta(session), [f"{f}:{r}" for r in missing for f in ("need", "fence")])
        if any(mark is not None for mark in marks):
            return 0
    roles = [role for role in ROLES if role in groups]
    async with client.pipeline() as pipe:
        last = pipe.hget(keys.meta(session), "last")
        pending = [pipe.xpending(key, role) for role in roles]
        await pipe.execute()
    point = int(last.value or 0) - keep_last
    for role, reply in zip(roles, pending, strict=True):
        point = min(point, entry_id(groups[role]["last-delivered-id"]))
        summary = reply.value
        if summary["pending"] > 0 and summary["min"] is not None:
            point = min(point, entry_id(summary["min"]) - 1)
    return max(point, 0)


async def retain(
    redis: RedisClient | RawClient,
    keys: Keys,
    archive: Archive,
    session: str,
    *,
    older_than_seconds: float,
    keep_last: int,
    url: str = "redis",
) -> int:
    """Archive and trim the events of ``session`` that are older than ``older_than_seconds``
    and that every role has finished with; returns how many were trimmed from Redis."""
    if keep_last < 1:
        raise InputError("retention keeps at least the last event in Redis: keep_last must be 1 or more")
    if not math.isfinite(older_than_seconds) or older_than_seconds < 0:
        raise InputError("the retention age must be a number of seconds, 0 or more")
    client = as_client(redis, url)
    point = await safe_point(client, keys, session, keep_last=keep_last)
    if point < 1:
        return 0
    cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=older_than_seconds)
    key = keys.log(session)
    trim = client.script(scripts.TRIM)
    trimmed = 0
    while True:
        entries = await client.xrange(key, "-", f"{point}-0", count=PAGE)
        rows: list[tuple[int, bytes]] = []
        young = False
        for raw_id, fields in entries:
            ts = _event_time(fields.get(PAYLOAD_FIELD, b""))
            if ts is not None and ts > cutoff:
                young = True
                break
            rows.append((entry_id(raw_id), fields.get(PAYLOAD_FIELD, b"")))
        if not rows:
            break
        new = await archive.copy(session, rows)
        reply = await trim([key, keys.meta(session)], [rows[-1][0]])
        if reply[0] != b"ok":
            break
        trimmed += int(reply[1])
        log.info("retention.trimmed", session=session, first=rows[0][0], to=rows[-1][0], copied=new)
        if young or len(entries) < PAGE:
            break
    return trimmed


class Retention:
    """Runs :func:`retain` over a changing set of sessions every ``period`` seconds."""

    def __init__(
        self,
        redis: RedisClient | RawClient,
        keys: Keys,
        archive: Archive,
        *,
        older_than_seconds: float,
        keep_last: int,
        period: float | None = None,
        url: str = "redis",
    ) -> None:
        self.redis = as_client(redis, url)
        self.keys = keys
        self.archive = archive
        self.older_than_seconds = older_than_seconds
        self.keep_last = keep_last
        self.period = period if period is not None else min(60.0, max(1.0, older_than_seconds / 4))
        self.trimmed = 0

    async def once(self, sessions: Iterable[str]) -> int:
        """One pass over ``sessions``; a session that fails is logged and skipped."""
        total = 0
        for session in sessions:
            try:
                total += await retain(
                    self.redis,
                    self.keys,
                    self.archive,
                    session,
                    older_than_seconds=self.older_than_seconds,
                    keep_last=self.keep_last,
                )
            except RiverbedError as exc:
                log.warning("retention.failed", session=session, error=str(exc))
            except Exception:
                log.exception("retention.failed", session=session)
        self.trimmed += total
        return total

    async def run(self, worker: str, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Every ``period``, the one worker that takes the pass lock runs a pass over every
        session of the prefix, idle (parked) ones included; the others skip that round."""
        task_status.started()
        lock_ms = int(self.period * 2000)
        while True:
            await anyio.sleep(self.period)
            try:
                if not await self.redis.set(self.keys.retention, worker, nx=True, px=lock_ms):
                    continue
                sessions = [s.decode() for s in await self.redis.zrange(self.keys.sessions)]
            except UnavailableError as exc:
                log.warning("retention.unavailable", error=str(exc))
                continue
            await self.once(sessions)

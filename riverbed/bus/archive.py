"""Retention: old events move from the Redis stream to a Postgres archive table.

A retention pass over one session (:func:`retain`):

1. finds the **safe point**: the highest event id that every role's consumer group on the log
   has been delivered (``last-delivered-id``) and that is below the first entry any group
   still has pending (``XPENDING`` summary); a role whose group does not exist yet has not
   seen the session at all, so nothing is trimmed; at least ``keep_last`` events stay;
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
import re
from collections.abc import AsyncIterator, Iterable, Sequence

import anyio
import asyncpg
import msgspec
import redis.exceptions as rexc
import structlog
from anyio.abc import TaskStatus
from asyncpg.pool import PoolConnectionProxy

from riverbed.bus import scripts
from riverbed.bus.connection import Client, redact, translate
from riverbed.bus.keys import PAYLOAD_FIELD, ROLES, Keys
from riverbed.bus.log import PAGE, entry_id
from riverbed.errors import ConfigError, InputError, RiverbedError, UnavailableError

__all__ = ["Archive", "Retention", "first_stream_id", "retain", "safe_point"]

log = structlog.get_logger("riverbed.retention")

#: The advisory lock key of the memory store's migrations: both create the same schema, and
#: two concurrent ``CREATE SCHEMA IF NOT EXISTS`` may otherwise fail on each other.
LOCK_KEY = 0x72697665726264

_SCHEMA_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_DB_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)

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


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class Archive:
    """The archive table over a small asyncpg pool.  The constructor does no I/O; the pool
    is opened (and the table created) by the first call that needs it."""

    def __init__(
        self,
        url: str,
        *,
        schema: str = "rb",
        max_size: int = 4,
        connect_timeout: float = 5.0,
        command_timeout: float = 60.0,
    ) -> None:
        if not _SCHEMA_RE.match(schema):
            raise ConfigError(f"schema {schema!r} is not valid: use lowercase letters, digits or underscores")
        self.url = url
        self.schema = schema
        self._s = _quote_ident(schema)
        self._max_size = max_size
        self._connect_timeout = connect_timeout
        self._command_timeout = command_timeout
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None
        self._start_lock = anyio.Lock()

    async def start(self) -> None:
        """Connect and create the table if missing (safe when several processes start at once)."""
        if self._pool is not None:
            return
        async with self._start_lock:
            if self._pool is None:
                await self._start()

    async def _start(self) -> None:
        try:
            with anyio.fail_after(self._connect_timeout * 3):
                conn = await asyncpg.connect(self.url, timeout=self._connect_timeout)
                try:
                    await self._migrate(conn)
                finally:
                    await conn.close()
                self._pool = await asyncpg.create_pool(
                    self.url,
                    min_size=1,
                    max_size=self._max_size,
                    timeout=self._connect_timeout,
                    command_timeout=self._command_timeout,
                )
        except _DB_ERRORS as exc:
            raise UnavailableError(
                f"the log archive in Postgres at {redact(self.url)} cannot be reached or prepared: {exc}"
            ) from exc

    async def _migrate(self, conn: asyncpg.Connection[asyncpg.Record]) -> list[int]:
        s = self._s
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_KEY)
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {s}.archive_migrations "
                "(version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {row["version"] for row in await conn.fetch(f"SELECT version FROM {s}.archive_migrations")}
            applied: list[int] = []
            for version, sql in MIGRATIONS:
                if version not in done:
                    await conn.execute(sql.format(s=s))
                    await conn.execute(f"INSERT INTO {s}.archive_migrations (version) VALUES ($1)", version)
                    applied.append(version)
            return applied

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with anyio.move_on_after(5, shield=True):
                await pool.close()

    @contextlib.asynccontextmanager
    async def _conn(self) -> AsyncIterator[PoolConnectionProxy[asyncpg.Record]]:
        await self.start()
        assert self._pool is not None
        try:
            async with self._pool.acquire(timeout=self._connect_timeout) as conn:
                yield conn
        except _DB_ERRORS as exc:
            raise UnavailableError(f"the log archive failed: {type(exc).__name__}: {exc}") from exc

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


async def first_stream_id(redis: Client, keys: Keys, session: str, *, url: str = "redis") -> int:
    """The id of the first event still in the Redis stream (0: the stream is empty)."""
    with translate(url):
        entries = await redis.xrange(keys.log(session), "-", "+", count=1)
    return entry_id(entries[0][0]) if entries else 0


async def safe_point(redis: Client, keys: Keys, session: str, *, keep_last: int, url: str = "redis") -> int:
    """The highest event id every role has finished with and that leaves ``keep_last`` events
    in the stream (0: nothing may be trimmed).

    A role has finished with an event when its group was delivered it and nothing at or
    before it is pending in the group.  A missing group means the role never saw the
    session: then nothing may be trimmed.
    """
    key = keys.log(session)
    try:
        with translate(url):
            groups = {g["name"].decode(): g for g in await redis.xinfo_groups(key)}
    except rexc.ResponseError as exc:
        if "no such key" in str(exc).lower():
            return 0
        raise
    if any(role not in groups for role in ROLES):
        return 0
    with translate(url):
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hget(keys.meta(session), "last")
            for role in ROLES:
                pipe.xpending(key, role)
            last_raw, *pending = await pipe.execute()
    point = int(last_raw or 0) - keep_last
    for role, summary in zip(ROLES, pending, strict=True):
        point = min(point, entry_id(groups[role]["last-delivered-id"]))
        if int(summary["pending"]) > 0:
            point = min(point, entry_id(summary["min"]) - 1)
    return max(point, 0)


async def retain(
    redis: Client,
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
    point = await safe_point(redis, keys, session, keep_last=keep_last, url=url)
    if point < 1:
        return 0
    cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=older_than_seconds)
    key = keys.log(session)
    trim = redis.register_script(scripts.TRIM)
    trimmed = 0
    while True:
        with translate(url):
            entries = await redis.xrange(key, "-", f"{point}-0", count=PAGE)
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
        with translate(url):
            reply = await trim(keys=[key, keys.meta(session)], args=[rows[-1][0]])
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
        redis: Client,
        keys: Keys,
        archive: Archive,
        *,
        older_than_seconds: float,
        keep_last: int,
        period: float | None = None,
        url: str = "redis",
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.archive = archive
        self.older_than_seconds = older_than_seconds
        self.keep_last = keep_last
        self.period = period if period is not None else min(60.0, max(1.0, older_than_seconds / 4))
        self.url = url
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
                    url=self.url,
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
                with translate(self.url):
                    if not await self.redis.set(self.keys.retention, worker, nx=True, px=lock_ms):
                        continue
                    sessions = [s.decode() for s in await self.redis.zrange(self.keys.sessions, 0, -1)]
            except UnavailableError as exc:
                log.warning("retention.unavailable", error=str(exc))
                continue
            await self.once(sessions)

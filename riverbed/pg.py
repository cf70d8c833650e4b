"""Postgres plumbing shared by the memory store and the log archive.

(SQL here is built only from quoted identifiers; every value is a bound parameter.)

- schema names (one per riverbed prefix) and identifier quoting;
- versioned migrations applied under one advisory lock, so several workers starting at
  once apply each version exactly once;
- :class:`LazyPool`: an asyncpg pool opened on first use, whose driver errors are translated
  at this boundary, once, by :func:`translate_error`: a connection that failed, timed out or
  was refused (SQLSTATE classes 08, 53, 57P0x, a statement timeout, OSError) is
  :class:`~riverbed.errors.UnavailableError` (retry later); a value Postgres cannot hold
  (classes 22 and 54, e.g. a NUL byte in text) is :class:`~riverbed.errors.DataError` (the
  entry's fault); any other refusal is :class:`~riverbed.errors.StorageError`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeAlias, TypedDict

import anyio
import asyncpg
from asyncpg.pool import PoolConnectionProxy

from riverbed.errors import ConfigError, DataError, RiverbedError, StorageError, UnavailableError

__all__ = [
    "DB_ERRORS",
    "LOCK_KEY",
    "LazyPool",
    "PoolOptions",
    "check_schema",
    "migrate",
    "quote_ident",
    "translate_error",
]

LOCK_KEY = 0x72697665726264  # "riverbd": every riverbed migration takes this advisory lock
DB_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)
_SCHEMA_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")

Connection: TypeAlias = "asyncpg.Connection[asyncpg.Record]"


#: SQLSTATEs (or their two-character classes) of a server that is unreachable, overloaded,
#: shutting down or too slow, and of a transaction that lost a race: trying again may succeed.
_TRANSIENT_STATES = ("08", "53", "57P01", "57P02", "57P03", "57014", "55P03", "40001", "40P01")
#: Classes of a value the server cannot hold: data_exception, program_limit_exceeded.
_DATA_CLASSES = ("22", "54")


def translate_error(exc: BaseException, what: str) -> RiverbedError:
    """The riverbed error for a driver error of ``what`` (a database), by its SQLSTATE."""
    state = str(getattr(exc, "sqlstate", "") or "")
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else "no answer in time"
    if isinstance(exc, OSError | TimeoutError) or (state and state.startswith(_TRANSIENT_STATES)):
        return UnavailableError(f"the {what} failed: {detail}")
    if (state and state.startswith(_DATA_CLASSES)) or isinstance(exc, UnicodeError):
        return DataError(f"the {what} cannot store a value: {detail}")
    if isinstance(exc, asyncpg.PostgresError):
        return StorageError(f"the {what} refused a statement: {detail}")
    # InterfaceError: the driver's state (a closed connection, a closing pool)
    return UnavailableError(f"the {what} failed: {detail}")


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def check_schema(schema: str) -> str:
    """``schema`` quoted for SQL; :class:`ConfigError` when it is not a valid schema name."""
    if not _SCHEMA_RE.fullmatch(schema):
        raise ConfigError(f"schema {schema!r} is not valid: use lowercase letters, digits or underscores")
    return quote_ident(schema)


async def migrate(
    conn: Connection,
    schema: str,
    *,
    table: str,
    migrations: Sequence[tuple[int, str]],
    before: Sequence[str] = (),
) -> list[int]:
    """Apply the ``migrations`` (version, SQL with ``{s}`` for the schema) not yet recorded in
    ``<schema>.<table>``, in one transaction under :data:`LOCK_KEY`; returns the versions applied.
    ``before`` runs first in the same transaction (e.g. ``CREATE EXTENSION``)."""
    s = check_schema(schema)
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_KEY)
        for sql in before:
            await conn.execute(sql)
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.{table} "
            "(version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {row["version"] for row in await conn.fetch(f"SELECT version FROM {s}.{table}")}  # noqa: S608
        applied: list[int] = []
        for version, sql in migrations:
            if version not in done:
                await conn.execute(sql.format(s=s))
                await conn.execute(f"INSERT INTO {s}.{table} (version) VALUES ($1)", version)  # noqa: S608
                applied.append(version)
        return applied


class PoolOptions(TypedDict, total=False):
    """The size and timeouts of a :class:`LazyPool` (its signature has the defaults), which the
    memory store and the log archive take as keyword arguments and pass on."""

    min_size: int
    max_size: int
    connect_timeout: float
    """seconds to open a connection"""
    command_timeout: float
    """seconds a statement may take"""


class LazyPool:
    """An asyncpg pool opened by :meth:`start` (once, even when called concurrently).

    ``prepare`` runs on a first connection before the pool opens (migrations); ``init`` on
    every pooled connection (codecs).  ``what`` names the database in error messages.
    """

    def __init__(
        self,
        url: str,
        *,
        what: str,
        prepare: Callable[[Connection], Awaitable[None]] | None = None,
        init: Callable[[Connection], Coroutine[Any, Any, None]] | None = None,
        min_size: int = 1,
        max_size: int = 10,
        connect_timeout: float = 5.0,
        command_timeout: float = 30.0,
    ) -> None:
        self.url = url
        self.what = what
        self._prepare = prepare
        self._init = init
        self._min_size = min_size
        self._max_size = max_size
        self._connect_timeout = connect_timeout
        self._command_timeout = command_timeout
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None
        self._lock = anyio.Lock()

    @property
    def started(self) -> bool:
        return self._pool is not None

    async def start(self) -> None:
        if self._pool is not None:
            return
        async with self._lock:
            if self._pool is not None:
                return
            try:
                with anyio.fail_after(self._connect_timeout * 3):
                    if self._prepare is not None:
                        conn = await asyncpg.connect(self.url, timeout=self._connect_timeout)
                        try:
                            await self._prepare(conn)
                        finally:
                            await conn.close()
                    self._pool = await asyncpg.create_pool(
                        self.url,
                        min_size=self._min_size,
                        max_size=self._max_size,
                        timeout=self._connect_timeout,
                        command_timeout=self._command_timeout,
                        init=self._init,
                    )
            except DB_ERRORS as exc:
                raise UnavailableError(f"the {self.what} cannot be reached or prepared: {exc}") from exc

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with anyio.move_on_after(5, shield=True):
                await pool.close()

    @contextlib.asynccontextmanager
    async def connection(self, *, timeout: float | None = None) -> AsyncIterator[PoolConnectionProxy[asyncpg.Record]]:
        """A pooled connection (the pool must be started), waited for at most ``timeout``
        seconds (default: the connect timeout); driver errors are translated by
        :func:`translate_error`."""
        if self._pool is None:
            raise UnavailableError(f"the {self.what} is not started (call start() first)")
        wait = self._connect_timeout if timeout is None else min(timeout, self._connect_timeout)
        try:
            async with self._pool.acquire(timeout=wait) as conn:
                yield conn
        except (*DB_ERRORS, UnicodeError) as exc:
            raise translate_error(exc, self.what) from exc

"""Every use riverbed makes of redis-py's private internals, in one place, for the versions named.

riverbed's fast path reaches under redis-py's public API where measurements said it must
(each class says why and what it saves):

- :class:`DirectSend` (the connections): writes in the caller's task, timer-bounded reads and
  writes, a one-write handshake, commands packed by hiredis.  Uses a connection's ``_writer``, ``_parser``,
  ``set_parser``, the RESP parsers of ``redis._parsers`` and ``_reset_himport_state``.
- :class:`QuickPool` (the pools): a lock-free hand-over of a free connection.  Uses a pool's
  ``_available_connections``, ``_in_use_connections``, ``_lock`` and ``_condition._waiters``.
- :class:`CommandTable` (the cluster's command table from any live primary): subclasses
  ``redis._parsers.commands.AsyncCommandsParser``.
- :class:`RetryPolicy`: copies a ``Retry`` from its ``_backoff``, ``_retries`` and
  ``_supported_errors``.
- :func:`socket_stream`: the connected socket's ``asyncio.StreamReader`` (``_reader``), which
  the wake-up feeds parse themselves.

They were written for, and are tested against, :data:`KNOWN`; pyproject.toml pins redis-py
below its next major.  :func:`missing_internals` lists what a redis-py at hand lacks, and the
test suite fails with that one sentence when an upgrade took one away.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import hiredis
import redis
import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis._parsers import _AsyncRESP2Parser, _AsyncRESP3Parser
from redis._parsers.commands import AsyncCommandsParser
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.cluster import PRIMARY

from riverbed.bus.backoff import RedisBackoff
from riverbed.errors import ConfigError

__all__ = [
    "KNOWN",
    "RECEIVE_BYTES",
    "BlockingPool",
    "CommandTable",
    "Pool",
    "check_internals",
    "missing_internals",
    "release_at_once",
    "retry_policy",
    "socket_stream",
]

KNOWN = "redis-py 7.1 to 8.1"
"""The redis-py versions these internals were written for and tested with."""


class CommandTable(AsyncCommandsParser):
    """redis-py's command table, loaded from any live primary.

    redis-py loads it from the cluster's default node whenever it re-reads the topology.  Right
    after a master fails over, a node that has not heard yet can still name the dead master as
    that default; the load then fails, redis-py closes every connection (also those in use by
    other commands) and fails the caller's command, although the cluster is whole again.
    """

    def __init__(self, cluster: RedisCluster) -> None:
        super().__init__()
        self._cluster = cluster

    async def initialize(self, node: Any = None) -> None:
        primaries = self._cluster.nodes_manager.get_nodes_by_server_type(PRIMARY)
        candidates = [node, *(n for n in primaries if n is not node)] if node is not None else primaries
        failure: Exception | None = None
        for candidate in candidates:
            try:
                await super().initialize(candidate)
                return
            except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
                failure = exc
        if failure is not None:
            raise failure
        await super().initialize(node)


RECEIVE_BYTES = 64 * 1024
"""The most one receive on a connection asks the kernel for, on asyncio's own event loop."""


def receive_at_most(writer: asyncio.StreamWriter | None, size: int) -> None:
    """Make the transport under ``writer`` receive at most ``size`` bytes at a time.

    asyncio's socket transport receives up to 256 KiB at a time, and Python allocates all of
    that for every receive before it shrinks it to what came: measured here, a 300-byte reply
    cost about 12 us more than a receive of at most 64 KiB (as much as the rest of the receive).
    redis-py parses 64 KiB at a time anyway.  uvloop's and TLS transports have no such
    attribute and receive into buffers of their own: they are left alone."""
    transport = writer.transport if writer is not None else None
    if transport is not None and isinstance(getattr(transport, "max_size", None), int):
        transport.max_size = size  # type: ignore[attr-defined]


class DirectSend:
    """A connection that writes a command in the caller's task, bounds its reads and writes with
    a timer, and pings no socket it just opened.

    redis-py wraps every write in ``asyncio.wait_for`` while ``socket_timeout`` is set (its
    default is 5 s), and on Python 3.11 that starts a task per command and gives up the event
    loop before the bytes leave: a burst of a thousand actions from one client then waits for
    all of them to be prepared before the first goes out.  Here the write happens at once.

    redis-py bounds every read with ``asyncio.timeout`` too: about 6 us each, and an action
    reads two replies on each side.  Here a write or a read that outlasts ``socket_timeout``
    has its connection closed by a timer instead (about 1 us), and fails as redis-py's would
    (the connection closed, ``TimeoutError``)."""

    socket_timeout: float | None
    health_check_interval: float
    next_health_check: float
    _writer: asyncio.StreamWriter | None
    _read_expired = False
    _write_expired = False
    refused: set[str] | None = None
    """The greeting's optional commands this connection's server refused (shared by its pool's
    connections): an older server (Redis 7.0 knows no ``CLIENT SETINFO``, no open-source Redis
    knows maintenance notifications) refuses them on every connection, so they are sent once."""

    async def on_connect_check_health(self, check_health: bool = True) -> None:
        receive_at_most(self._writer, RECEIVE_BYTES)
        # A socket opened this moment needs no PING to prove it is alive, and redis-py sends one
        # before its HELLO (a round trip more for every new connection, a thousand in a burst).
        if self.health_check_interval:
            self.next_health_check = asyncio.get_running_loop().time() + self.health_check_interval
        if not await self._handshake():
            await super().on_connect_check_health(check_health)  # type: ignore[misc]

    async def _handshake(self) -> bool:
        """The greeting of a new RESP3 connection in one write: ``HELLO`` (with its ``AUTH`` and
        ``SETNAME``), redis-py's request for maintenance notifications, ``CLIENT SETINFO`` and
        ``SELECT``.  redis-py sends them in three to six rounds, each a turn of what may be a
        busy event loop (a burst opening hundreds of connections); an optional one the server
        refused before (:attr:`refused`) is left out.  False, with nothing sent, where redis-py's
        own way is needed: RESP2, or a credential provider."""
        conn: Any = self
        if str(conn.protocol) != "3" or conn.credential_provider is not None:
            return False
        if hasattr(conn, "_reset_himport_state"):
            conn._reset_himport_state()  # as redis-py does for a new server session
        parser: Any = conn._parser
        parser.on_connect(conn)
        if isinstance(parser, _AsyncRESP2Parser):
            errors = parser.EXCEPTION_CLASSES
            conn.set_parser(_AsyncRESP3Parser)
            conn._parser.EXCEPTION_CLASSES = errors
            conn._parser.on_connect(conn)
        hello: list[Any] = ["HELLO", 3]
        if conn.username or conn.password:
            hello += ["AUTH", conn.username or "default", conn.password or ""]
        if conn.client_name:
            hello += ["SETNAME", conn.client_name]
        # (what each reply is, whether an error from the server may be passed over, the command)
        greeting: list[tuple[str, bool, list[Any]]] = [("hello", False, hello)]
        maint = getattr(conn, "maint_notifications_config", None)
        if maint is not None and maint.enabled and getattr(conn, "_maint_notifications_connection_handler", None):
            kind = maint.get_endpoint_type(conn.host, conn).value
            greeting.append(
                (
                    "maint",
                    maint.enabled == "auto",
                    ["CLIENT", "MAINT_NOTIFICATIONS", "ON", "moving-endpoint-type", kind],
                )
            )
        info = conn.driver_info
        if info is not None and info.formatted_name:
            greeting.append(("info", True, ["CLIENT", "SETINFO", "LIB-NAME", info.formatted_name]))
        if info is not None and info.lib_version:
            greeting.append(("info", True, ["CLIENT", "SETINFO", "LIB-VER", info.lib_version]))
        if conn.db:
            greeting.append(("select", False, ["SELECT", conn.db]))
        refused = self.refused
        if refused:
            greeting = [line for line in greeting if not (line[1] and _name(line[2]) in refused)]
        await conn.send_packed_command(conn.pack_commands([command for *_, command in greeting]), check_health=False)
        failure: Exception | None = None
        for what, optional, command in greeting:
            try:
                reply = await conn.read_response()
            except rexc.ResponseError as exc:
                # An older server without SETINFO or maintenance notifications: redis-py goes on too.
                if not optional:
                    failure = failure or exc
                elif refused is not None:
                    refused.add(_name(command))
                continue
            if what == "select" and reply not in (b"OK", "OK") and failure is None:
                failure = rexc.ConnectionError("Invalid Database")
        if failure is not None:
            raise failure  # every reply is read: the connection stays in step
        return True

    def pack_command(self, *args: Any) -> list[bytes]:
        """A command as Redis takes it, packed by hiredis: about 2 us against redis-py's 17 for
        an append's script call (26 arguments), made a few times a step by every role.  What
        hiredis packs differently goes redis-py's way: a first argument of several words
        (``CONFIG GET``), another encoding than UTF-8, a value neither bytes, str, int nor float
        (redis-py's error for it)."""
        first = args[0]
        one_word = b" " not in first if type(first) is bytes else type(first) is str and " " not in first
        encoder: Any = self.encoder  # type: ignore[attr-defined]
        if one_word and encoder.encoding == "utf-8" and encoder.encoding_errors == "strict":
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                pass
        return super().pack_command(*args)  # type: ignore[misc,no-any-return]

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        timeout = self.socket_timeout
        if not timeout or self._writer is None:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
            return
        # redis-py writes at once when it has no socket timeout; the one it would have had
        # bounds the write here instead, in this task.
        self.socket_timeout = None
        self._write_expired = False
        timer = asyncio.get_running_loop().call_later(timeout, self._expire_write)
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except rexc.ConnectionError:
            if self._write_expired:
                raise rexc.TimeoutError("Timeout writing to socket") from None
            raise
        finally:
            timer.cancel()
            if self.socket_timeout is None:  # (unless redis-py changed it meanwhile)
                self.socket_timeout = timeout
        if self._write_expired:  # (a write waiting for the socket ends quietly when it closes)
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise rexc.TimeoutError("Timeout writing to socket")

    async def read_response(self, disable_decoding: bool = False, timeout: float | None = None, **options: Any) -> Any:
        limit = self.socket_timeout
        if timeout is not None or not limit or self._writer is None:
            return await super().read_response(disable_decoding, timeout, **options)  # type: ignore[misc]
        self.socket_timeout = None
        self._read_expired = False
        timer = asyncio.get_running_loop().call_later(limit, self._expire_read)
        try:
            response = await super().read_response(disable_decoding, None, **options)  # type: ignore[misc]
        except rexc.ConnectionError:
            if self._read_expired:
                raise rexc.TimeoutError("Timeout reading from the Redis server") from None
            raise
        finally:
            timer.cancel()
            if self.socket_timeout is None:
                self.socket_timeout = limit
        if self._read_expired:  # the reply came as the timer closed the connection: not reused
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
        return response

    def _expire_write(self) -> None:
        self._write_expired = True
        self._abort()

    def _expire_read(self) -> None:
        self._read_expired = True
        self._abort()

    def _abort(self) -> None:
        """Close the connection under a write or read that took too long: it fails at once."""
        if self._writer is not None:
            self._writer.transport.abort()


def _name(command: list[Any]) -> str:
    """A greeting command's name and subcommands (``CLIENT SETINFO LIB-NAME``)."""
    return " ".join(str(word) for word in command[:3])


class _Connection(DirectSend, aioredis.Connection):
    pass


class _SSLConnection(DirectSend, aioredis.SSLConnection):
    pass


class _UnixConnection(DirectSend, aioredis.UnixDomainSocketConnection):
    pass


_DIRECT: dict[type, type] = {
    aioredis.Connection: _Connection,
    aioredis.SSLConnection: _SSLConnection,
    aioredis.UnixDomainSocketConnection: _UnixConnection,
}


class QuickPool:
    """The pool's hand-over without its ceremony: a free, connected connection is handed out
    and taken back in a few steps, with no lock (one event loop), no probe for unread data
    (redis-py closes a connection whose reply was not read, cancellations included) and no
    usage counters nobody reads.  That was about 16 us per command, on each side of every
    action.  Anything else (no free connection, one to reconnect, a waiter to wake, a
    maintenance handover) goes the pool's own way.  Its connections are :class:`DirectSend`."""

    _available_connections: list[Any]
    _in_use_connections: set[Any]

    _lock: Any
    connection_class: type

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection_class = _DIRECT.get(self.connection_class, self.connection_class)
        self._refused: set[str] = set()

    def make_connection(self) -> Any:
        connection = super().make_connection()  # type: ignore[misc]
        if isinstance(connection, DirectSend):
            connection.refused = self._refused
        return connection

    def spare(self, most: int) -> bool:
        """Whether a command now gets a free connection, or may open one (fewer than ``most``
        are in use)."""
        return bool(self._available_connections) or len(self._in_use_connections) < most

    def _quick(self) -> bool:
        # A maintenance handover (redis-py's MOVING notifications) rewrites the pool under its
        # lock, flagging a blocking pool as in maintenance: then the pool's own way, with the lock.
        return not self._lock.locked() and not getattr(self, "_in_maintenance", False)

    async def get_connection(self, command_name: Any = None, *keys: Any, **options: Any) -> Any:
        free = self._available_connections
        if free and free[-1].is_connected and self._quick():
            connection = free.pop()
            self._in_use_connections.add(connection)
            return connection
        return await super().get_connection()  # type: ignore[misc]

    def quick_release(self, connection: Any) -> bool:
        """Take ``connection`` back at once; False (nothing done) when the pool's own release
        must: a waiter to wake, a connection to reconnect, a maintenance handover."""
        condition = getattr(self, "_condition", None)
        if (condition is not None and condition._waiters) or connection.should_reconnect() or not self._quick():
            return False
        self._in_use_connections.remove(connection)
        self._available_connections.append(connection)
        return True

    async def release(self, connection: Any) -> None:
        if not self.quick_release(connection):
            await super().release(connection)  # type: ignore[misc]


def release_at_once(pool: Any, connection: Any) -> bool:
    """Hand ``connection`` back to ``pool`` now, without waiting, where the pool allows
    (:class:`QuickPool`: nobody waits, nothing to reconnect); False when the caller must
    ``await pool.release``."""
    return isinstance(pool, QuickPool) and pool.quick_release(connection)


class Pool(QuickPool, aioredis.ConnectionPool):
    pass


class BlockingPool(QuickPool, aioredis.BlockingConnectionPool):
    pass


class RetryPolicy(Retry):
    """redis-py deep-copies a connection's retry policy for every connection it opens (it may
    change the errors it retries on), about a tenth of what opening one costs a client; a
    new policy with the same (immutable) backoff is as good a copy."""

    def __deepcopy__(self, memo: dict[int, Any]) -> RetryPolicy:
        return RetryPolicy(self._backoff, self._retries, self._supported_errors)


def retry_policy() -> Retry:
    return RetryPolicy(RedisBackoff(first=0.05, cap=1.0), retries=6)


def socket_stream(connection: Any) -> asyncio.StreamReader:
    """The connected socket's stream of a connection (a wake-up feed parses its bytes itself)."""
    stream: asyncio.StreamReader = connection._reader
    return stream


def missing_internals() -> list[str]:
    """The internals riverbed uses that the installed redis-py lacks (empty: all there)."""
    connection = aioredis.Connection()
    pool = aioredis.BlockingConnectionPool()
    retry = Retry(RedisBackoff(first=0.05, cap=1.0), retries=1)
    wanted: list[tuple[str, object, str]] = [
        *(("Connection", connection, name) for name in ("_writer", "_reader", "_parser", "set_parser")),
        *(("BlockingConnectionPool", pool, name) for name in ("_available_connections", "_in_use_connections")),
        *(("BlockingConnectionPool", pool, name) for name in ("_lock", "_condition")),
        ("BlockingConnectionPool._condition", getattr(pool, "_condition", None), "_waiters"),
        *(("Retry", retry, name) for name in ("_backoff", "_retries", "_supported_errors")),
        ("_AsyncRESP2Parser", _AsyncRESP2Parser, "EXCEPTION_CLASSES"),
        ("_AsyncRESP3Parser", _AsyncRESP3Parser, "on_connect"),
        ("AsyncCommandsParser", AsyncCommandsParser, "initialize"),
    ]
    return [f"{owner}.{name}" for owner, obj, name in wanted if not hasattr(obj, name)]


@functools.cache
def check_internals() -> None:
    """A :class:`ConfigError` naming what is missing when the installed redis-py lacks an
    internal (checked once per process, when it first connects)."""
    missing = missing_internals()
    if missing:
        raise ConfigError(
            f"redis-py {redis.__version__} lacks {', '.join(missing)}, which riverbed's connections use "
            f"(written for {KNOWN}): install a redis-py riverbed supports (see pyproject.toml)"
        )

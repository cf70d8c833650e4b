"""Connecting to Redis: standalone or Cluster, decided from the URL alone.

A URL whose server reports ``cluster_enabled:1`` gets a ``RedisCluster`` client; every
other URL a plain client.  Both retry a failed command with exponential backoff, and
:func:`translate` turns redis-py's connection errors into :class:`UnavailableError`.  Code
calls Redis through :class:`riverbed.bus.redis_client.RedisClient`, which wraps that client and
translates every call's errors itself.

The cluster client finds the keys of ``XREAD`` and ``XREADGROUP`` (the blocking reads of every
worker and client) itself.  redis-py asks one fixed node with ``COMMAND GETKEYS`` before each of
them: a round trip more per read, all on that node, and every read fails while that node is
down, even when its slot moved to a live replica long ago.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import Iterator
from importlib import metadata
from typing import Any, TypeAlias, cast
from urllib.parse import urlsplit, urlunsplit

import anyio
import redis
import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis._parsers import _AsyncRESP2Parser, _AsyncRESP3Parser
from redis._parsers.commands import AsyncCommandsParser
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.cluster import PRIMARY

from riverbed.bus.backoff import RedisBackoff
from riverbed.errors import REDIS_MIN_VERSION, ConfigError, InputError, UnavailableError

__all__ = [
    "Cluster",
    "RawClient",
    "Turn",
    "connect_redis",
    "redact",
    "release_at_once",
    "stream_read_keys",
    "too_large",
    "translate",
]


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


@contextlib.contextmanager
def translate(url: str) -> Iterator[None]:
    """Turn redis-py's connection errors into :class:`UnavailableError`."""
    try:
        yield
    except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
        raise UnavailableError(f"cannot reach Redis at {redact(url)}: {exc}") from exc
    except (rexc.ClusterDownError, rexc.TryAgainError, rexc.SlotNotCoveredError) as exc:
        raise UnavailableError(f"the Redis Cluster at {redact(url)} is not serving every slot: {exc}") from exc
    except rexc.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise ConfigError(f"Redis at {redact(url)} refused the credentials: {exc}") from exc
        if too_large(exc):
            raise InputError(
                f"Redis at {redact(url)} refused a value as too large ({exc}); keep RIVERBED_MAX_EVENT_BYTES "
                "below its proto-max-bulk-len"
            ) from exc
        raise


_TOO_LARGE = ("invalid bulk length", "exceeds maximum allowed size", "too large", "proto-max-bulk-len")


def too_large(exc: rexc.ResponseError) -> bool:
    """Whether Redis refused a command because a value is over its size limit: the data's
    fault, so an :class:`InputError` (a retry cannot help), never "cannot reach Redis"."""
    text = str(exc).lower()
    return any(marker in text for marker in _TOO_LARGE)


def stream_read_keys(command: str, args: tuple[Any, ...]) -> list[Any] | None:
    """The keys of an ``XREAD``/``XREADGROUP`` command line (``args`` after the command name),
    parsed as Redis does; None for any other command or a line it would refuse."""
    name = command.upper()
    if name not in ("XREAD", "XREADGROUP"):
        return None
    i = 0
    if name == "XREADGROUP":
        if not args or _word(args[0]) != "GROUP":
            return None
        i = 3
    while i < len(args):
        word = _word(args[i])
        if word in ("COUNT", "BLOCK"):
            i += 2
        elif word == "NOACK":
            i += 1
        elif word == "STREAMS":
            rest = args[i + 1 :]
            if not rest or len(rest) % 2:
                return None
            return list(rest[: len(rest) // 2])
        else:
            return None
    return None


def _word(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace").upper()
    return str(value).upper()


class _CommandTable(AsyncCommandsParser):
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


def closed_under_us(exc: BaseException) -> bool:
    """Whether ``exc`` is redis-py leaking a transport's internals because a connection was
    closed while a command was on it (another task dropped it in a failover, or the peer reset
    it): ``'NoneType' object has no attribute 'writelines'``, or ``... is not callable``
    (redis/redis-py#4287).  That is a lost connection."""
    return isinstance(exc, AttributeError | TypeError) and "'NoneType' object" in str(exc)


@contextlib.contextmanager
def _closed_under_us() -> Iterator[None]:
    """A connection closed under a command (:func:`closed_under_us`) raises a ConnectionError,
    so that :func:`translate` and every retry treat it as the lost connection it is."""
    try:
        yield
    except (AttributeError, TypeError) as exc:
        if not closed_under_us(exc):
            raise
        raise rexc.ConnectionError(f"the connection was closed under a command ({exc})") from exc


class Turn:
    """``async with Turn(limiter)``: one of a :class:`anyio.CapacityLimiter`'s tokens, taken
    without yielding to the event loop when one is free and nobody waits (``async with limiter``
    always yields first).  That keeps an action's answer on its way before the worker turns to
    other work that came in with the action."""

    __slots__ = ("_limiter",)

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        self._limiter = limiter

    async def __aenter__(self) -> None:
        # The turn itself borrows the token: anyio's own borrower, the current task, costs a
        # lookup on each side of every command.
        try:
            self._limiter.acquire_on_behalf_of_nowait(self)
        except anyio.WouldBlock:
            await self._limiter.acquire_on_behalf_of(self)

    async def __aexit__(self, *exc: object) -> None:
        self._limiter.release_on_behalf_of(self)


RECEIVE_BYTES = 64 * 1024
"""The most one receive on a connection asks the kernel for, on asyncio's own event loop."""


def _receive_at_most(writer: asyncio.StreamWriter | None, size: int) -> None:
    """Make the transport under ``writer`` receive at most ``size`` bytes at a time.

    asyncio's socket transport receives up to 256 KiB at a time, and Python allocates all of
    that for every receive before it shrinks it to what came: measured here, a 300-byte reply
    cost about 12 us more than a receive of at most 64 KiB (as much as the rest of the receive).
    redis-py parses 64 KiB at a time anyway.  uvloop's and TLS transports have no such
    attribute and receive into buffers of their own: they are left alone."""
    transport = writer.transport if writer is not None else None
    if transport is not None and isinstance(getattr(transport, "max_size", None), int):
        transport.max_size = size  # type: ignore[attr-defined]


class _DirectSend:
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
        _receive_at_most(self._writer, RECEIVE_BYTES)
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


class _Connection(_DirectSend, aioredis.Connection):
    pass


class _SSLConnection(_DirectSend, aioredis.SSLConnection):
    pass


class _UnixConnection(_DirectSend, aioredis.UnixDomainSocketConnection):
    pass


_DIRECT: dict[type, type] = {
    aioredis.Connection: _Connection,
    aioredis.SSLConnection: _SSLConnection,
    aioredis.UnixDomainSocketConnection: _UnixConnection,
}


class _Quick:
    """The pool's hand-over without its ceremony: a free, connected connection is handed out
    and taken back in a few steps, with no lock (one event loop), no probe for unread data
    (redis-py closes a connection whose reply was not read, cancellations included) and no
    usage counters nobody reads.  That was about 16 us per command, on each side of every
    action.  Anything else (no free connection, one to reconnect, a waiter to wake, a
    maintenance handover) goes the pool's own way.  Its connections are :class:`_DirectSend`."""

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
        if isinstance(connection, _DirectSend):
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
    (:class:`_Quick`: nobody waits, nothing to reconnect); False when the caller must
    ``await pool.release``."""
    return isinstance(pool, _Quick) and pool.quick_release(connection)


class _Pool(_Quick, aioredis.ConnectionPool):
    pass


class _BlockingPool(_Quick, aioredis.BlockingConnectionPool):
    pass


class Standalone(aioredis.Redis):
    """A standalone client whose commands raise a connection closed under them as lost
    (:func:`_closed_under_us`)."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        with _closed_under_us():
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


class Shared(Standalone):
    """A standalone client shared by many tasks: at most ``limit`` commands at once, the rest
    waiting their turn in order (an ``anyio.CapacityLimiter`` is first come, first served; the
    pool's own wait is not, and under load it kept some commands waiting for half a second)."""

    limiter: anyio.CapacityLimiter

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        async with Turn(self.limiter):
            return await super().execute_command(*args, **options)


class Cluster(RedisCluster):
    """``RedisCluster`` that routes stream reads by their keys without asking a server, loads its
    command table from a live primary (:class:`_CommandTable`) and, when ``limit`` is set, runs
    at most that many commands and ``spare`` pipelines at once, one of them kept for lease
    renewals (each node's pool then never opens more than ``limit + spare`` connections:
    redis-py's cluster client fails a command beyond ``max_connections`` instead of waiting, and
    a pipeline that fails so closes every connection of the client, the other commands'
    included)."""

    def __init__(self, *args: Any, limit: int | None = None, spare: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands_parser = _CommandTable(self)
        self.limiter = anyio.CapacityLimiter(limit) if limit is not None else None
        # A pipeline takes at most one connection per node.  Not a command's turn: a pipeline
        # that redis-py redirects sends its commands again one by one, each taking a turn.  One
        # spare connection is kept for the lease renewals: pipelines held up by a node that
        # stopped answering (up to a socket timeout per try, and redis-py tries again) must not
        # hold up the renewals of the sessions on the other nodes.
        limited = limit is not None and spare > 0
        self.pipelines = anyio.CapacityLimiter(max(1, spare - 1)) if limited else None
        self.renewals = anyio.CapacityLimiter(1) if limited and spare > 1 else self.pipelines

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None, *, renewal: bool = False
    ) -> ClusterPipeline:
        """``renewal``: the pipeline renews leases and runs on the connection kept for that."""
        turns = self.renewals if renewal else self.pipelines
        if turns is None or transaction or shard_hint:
            return super().pipeline(transaction, shard_hint)
        return _TurnTakingPipeline(self, turns)  # type: ignore[abstract]

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self.limiter is None:
            with _closed_under_us():
                return await super().execute_command(*args, **kwargs)
        async with Turn(self.limiter):
            with _closed_under_us():
                return await super().execute_command(*args, **kwargs)

    async def _determine_slot(self, command: str, *args: Any) -> int:
        keys = stream_read_keys(command, args)
        if not keys:
            return await super()._determine_slot(command, *args)
        slots = {self.keyslot(key) for key in keys}
        if len(slots) != 1:
            raise rexc.RedisClusterException(f"{command} - all keys must map to the same key slot")
        return slots.pop()


class _TurnTakingPipeline(ClusterPipeline):
    """A cluster pipeline that runs when one of ``turns``'s tokens is free."""

    def __init__(self, client: Cluster, turns: anyio.CapacityLimiter) -> None:
        super().__init__(client)
        self.turns = turns

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        async with Turn(self.turns):
            with _closed_under_us():
                return await super().execute(raise_on_error, allow_redirections)


RawClient: TypeAlias = aioredis.Redis | RedisCluster
"""What :func:`connect_redis` returns (a :class:`Cluster` for a cluster)."""


@functools.cache
def _driver_info() -> dict[str, Any]:
    """``CLIENT SETINFO`` names riverbed.  Given once, the versions also spare redis-py reading
    its package metadata for every new connection (a worker opens one per session it owns)."""
    try:
        from redis.driver_info import DriverInfo  # noqa: PLC0415  (redis-py 7.1 and later)
    except ImportError:
        return {}
    try:
        ours = metadata.version("riverbed")
    except metadata.PackageNotFoundError:
        ours = "0"
    return {"driver_info": DriverInfo(lib_version=redis.__version__).add_upstream_driver("riverbed", ours)}


class _Retry(Retry):
    """redis-py deep-copies a connection's retry policy for every connection it opens (it may
    change the errors it retries on), about a tenth of what opening one costs a client; a
    new policy with the same (immutable) backoff is as good a copy."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Retry:
        return _Retry(self._backoff, self._retries, self._supported_errors)


def _retry() -> Retry:
    return _Retry(RedisBackoff(first=0.05, cap=1.0), retries=6)


#: How long a command of a ``shared`` client waits for a free connection before it fails.
POOL_WAIT_SECONDS = 20.0
#: Connections a shared cluster client may open per node beyond its command limit (pipelines
#: and transactions are not counted by the limit).
CLUSTER_SPARE = 4


def _version(text: str) -> tuple[int, ...]:
    """``7.0.15`` as (7, 0, 15); what is not a number counts as 0."""
    return tuple(int(part) if part.isdigit() else 0 for part in text.split(".")[:3])


def _check_version(url: str, version: str) -> None:
    if _version(version) < REDIS_MIN_VERSION:
        wanted = ".".join(map(str, REDIS_MIN_VERSION))
        raise ConfigError(f"the Redis at {redact(url)} is {version}; riverbed needs Redis {wanted} or newer")


async def connect_redis(
    url: str,
    *,
    max_connections: int = 2000,
    shared: bool = False,
    name: str | None = None,
    spare: int = CLUSTER_SPARE,
) -> RawClient:
    """A connected client for ``url``; raises ConfigError or UnavailableError in one sentence.

    ``shared``: a worker's client, shared by every session it owns.  It holds at most
    ``max_connections`` per node, and a command waits for a free one rather than opening more,
    so the connections do not grow with the sessions.  ``name``: every connection's
    ``CLIENT SETNAME`` (``CLIENT LIST`` then shows whose connections they are).  ``spare``:
    connections a shared cluster client may open per node beyond ``max_connections`` for
    pipelines (0 for a client that sends none).
    """
    common: dict[str, Any] = {
        "retry": _retry(),
        "retry_on_error": [rexc.ConnectionError, rexc.TimeoutError],
        "socket_connect_timeout": 5,
        "health_check_interval": 15,
        **_driver_info(),
    }
    if name is not None:
        common["client_name"] = re.sub(r"[^!-~]", "_", name)  # a client name is one word of printable ASCII
    try:
        if shared:
            # The pool still waits (rather than fails) for what the limiter does not count:
            # pipelines and the exchanges of ``bus/exchange.py``, which take a connection themselves.
            pool = _BlockingPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_SECONDS, **common)
            shared_client = cast(Shared, Shared.from_pool(pool))
            shared_client.limiter = anyio.CapacityLimiter(max_connections)
            client: aioredis.Redis = shared_client
        else:
            client = Standalone.from_pool(_Pool.from_url(url, max_connections=max_connections, **common))
    except ValueError as exc:
        raise ConfigError(f"the Redis URL {redact(url)!r} is not valid: {exc}") from exc
    try:
        with translate(url):
            _check_version(url, str((await client.info("server")).get("redis_version", "0")))
            info = await client.info("cluster")
    except BaseException:
        await client.aclose()
        raise
    if not info.get("cluster_enabled"):
        return client
    await client.aclose()
    if shared:
        cluster = Cluster.from_url(
            url, max_connections=max_connections + spare, limit=max_connections, spare=spare, **common
        )
    else:
        cluster = Cluster.from_url(url, max_connections=max_connections, **common)
    with translate(url):
        await cluster.initialize()
    return cluster

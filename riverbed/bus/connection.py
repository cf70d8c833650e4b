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
from redis.asyncio.cluster import ClusterPipeline, RedisCluster

from riverbed.bus._redispy import (
    RECEIVE_BYTES,
    BlockingPool,
    CommandTable,
    Pool,
    check_internals,
    release_at_once,
    retry_policy,
)
from riverbed.errors import REDIS_MIN_VERSION, ConfigError, InputError, UnavailableError

__all__ = [
    "RECEIVE_BYTES",
    "Cluster",
    "RawClient",
    "Turn",
    "connect_redis",
    "group_lost",
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


def closed_under_us(exc: BaseException) -> bool:
    """Whether ``exc`` is redis-py leaking a transport's internals because a connection was
    closed while a command was on it (another task dropped it in a failover, or the peer reset
    it): ``'NoneType' object has no attribute 'writelines'``, or ``... is not callable``
    (redis/redis-py#4287), or under uvloop a write to the closed transport (``unable to perform
    operation on <TCPTransport closed=True ...>; the handler is closed``).  That is a lost
    connection."""
    if isinstance(exc, RuntimeError):
        return "the handler is closed" in str(exc)
    return isinstance(exc, AttributeError | TypeError) and "'NoneType' object" in str(exc)


def group_lost(exc: Exception) -> bool:
    """Whether Redis answered that a consumer group (or its stream) does not exist (any more)."""
    return isinstance(exc, rexc.ResponseError) and str(exc).startswith(("NOGROUP", "UNBLOCKED"))


@contextlib.contextmanager
def _closed_under_us() -> Iterator[None]:
    """A connection closed under a command (:func:`closed_under_us`) raises a ConnectionError,
    so that :func:`translate` and every retry treat it as the lost connection it is."""
    try:
        yield
    except (AttributeError, TypeError, RuntimeError) as exc:
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
    command table from a live primary (:class:`~riverbed.bus._redispy.CommandTable`) and, when ``limit`` is set, runs
    at most that many commands and ``spare`` pipelines at once, one of them kept for lease
    renewals (each node's pool then never opens more than ``limit + spare`` connections:
    redis-py's cluster client fails a command beyond ``max_connections`` instead of waiting, and
    a pipeline that fails so closes every connection of the client, the other commands'
    included)."""

    def __init__(self, *args: Any, limit: int | None = None, spare: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands_parser = CommandTable(self)
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
    check_internals()
    common: dict[str, Any] = {
        "retry": retry_policy(),
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
            pool = BlockingPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_SECONDS, **common)
            shared_client = cast(Shared, Shared.from_pool(pool))
            shared_client.limiter = anyio.CapacityLimiter(max_connections)
            client: aioredis.Redis = shared_client
        else:
            client = Standalone.from_pool(Pool.from_url(url, max_connections=max_connections, **common))
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

"""riverbed's one door to Redis: the commands it uses, typed, their errors translated once.

redis-py's methods answer ``bytes | str | ...`` unions (its client may decode or not) and raise
its own exceptions.  :class:`RedisClient` wraps the client that
:func:`~riverbed.bus.connection.connect_redis` made (standalone or cluster) and offers
exactly the commands riverbed sends, each typed as this client answers it (bytes, never
decoded) and each raising riverbed's errors (:func:`~riverbed.bus.connection.translate`:
:class:`UnavailableError`, :class:`ConfigError`, :class:`InputError`), so callers neither
wrap calls nor guess reply shapes.  A server error that is the caller's to judge
(``NOGROUP``, ``NOSCRIPT``) stays a :class:`redis.exceptions.ResponseError`.

Replies are in Redis' own terms, narrowed: a stream entry is ``(entry id, fields)``
(:data:`StreamEntry`), an entry deleted while pending has empty fields.  Reads of one stream
return its entries, not redis-py's per-stream nesting.

Three ways out of the single-command shape:

- :meth:`RedisClient.script` registers a Lua script (``EVALSHA``, loaded on ``NOSCRIPT``);
- :meth:`RedisClient.pipeline` queues commands for one round trip (one per node on a cluster);
  each queued command gives a typed :class:`Reply`, filled in when the pipeline runs;
- :meth:`RedisClient.exchange` sends raw commands together on one pooled connection
  (``bus/exchange.py``), translating errors like every other call.

:attr:`RedisClient.raw` is the redis-py client itself, for what has no method here (tests,
and ``bus/consumer.py`` and ``bus/exchange.py`` until they go through this class).  The bus's
parts (``Log``, ``Leases``, ``Claims``, ``DeadLetters``, the ``stats`` reads...) take either a
:class:`RedisClient` or a redis-py client, which :func:`as_client` wraps.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Generic, TypeAlias, TypedDict, TypeVar, cast

import anyio
import redis.exceptions as rexc
from redis.asyncio.client import Pipeline as RawPipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.commands.core import AsyncScript
from redis.typing import EncodableT

from riverbed.bus.connection import Cluster, RawClient, redact, translate
from riverbed.bus.exchange import Exchange, exchange
from riverbed.errors import UnavailableError

__all__ = [
    "Arg",
    "GroupInfo",
    "PendingCount",
    "PendingEntry",
    "PendingSummary",
    "Pipeline",
    "RawClient",
    "RedisClient",
    "Reply",
    "Script",
    "StreamEntry",
    "as_client",
]

StreamEntry: TypeAlias = tuple[bytes, dict[bytes, bytes]]
"""A stream entry: its id (``b"12-0"``) and its fields (empty for an entry deleted while pending)."""
Arg: TypeAlias = bytes | str | int | float
"""A value Redis takes as an argument."""
T = TypeVar("T")
_UNSET: Any = object()
GroupInfo = TypedDict("GroupInfo", {"name": bytes, "consumers": int, "pending": int, "last-delivered-id": bytes})
"""A consumer group as ``XINFO GROUPS`` describes it (Redis 7 adds fields not used here)."""


class PendingSummary(TypedDict):
    """``XPENDING key group``: how many entries are pending, the lowest and highest id (None:
    nothing pending) and how many each consumer holds."""

    pending: int
    min: bytes | None
    max: bytes | None
    consumers: list[PendingCount]


class PendingCount(TypedDict):
    name: bytes
    pending: int


class PendingEntry(TypedDict):
    """An entry of ``XPENDING key group start end count``."""

    message_id: bytes
    consumer: bytes
    time_since_delivered: int
    """Milliseconds."""
    times_delivered: int


class RedisClient:
    """The Redis commands riverbed uses, on one redis-py client; errors name ``url`` (redacted).

    Constructing one does no I/O; several may share one redis-py client (and its pool).
    """

    def __init__(self, raw: RawClient, url: str = "redis") -> None:
        self._raw = raw
        self.url = redact(url)
        # Asked on every append: redis-py's cluster class is a typing protocol's subclass, whose
        # isinstance check runs Python code each time.
        self._cluster = isinstance(raw, RedisCluster)

    @property
    def cluster(self) -> bool:
        """Whether this is a Redis Cluster client (a script then touches one slot only)."""
        return self._cluster

    @property
    def raw(self) -> RawClient:
        """The redis-py client: its errors are not translated and its replies not typed.  For
        what this class has no method for (raw commands on a held connection, tests)."""
        return self._raw

    async def aclose(self) -> None:
        await self._raw.aclose()

    # --- scripts, pipelines, exchanges ------------------------------------------------------

    def script(self, source: str) -> Script:
        """A Lua script, run with ``EVALSHA`` (and loaded first where the server lacks it)."""
        return Script(self._raw.register_script(source), self.url)

    async def script_load(self, source: str) -> str:
        """Load ``source`` into the script cache (every primary on a cluster); its SHA1."""
        with translate(self.url):
            return await self._raw.script_load(source)

    @contextlib.asynccontextmanager
    async def pipeline(self, *, renewal: bool = False) -> AsyncIterator[Pipeline]:
        """Commands queued in the block, sent by :meth:`Pipeline.execute` (no transaction).
        ``renewal``: lease renewals, which a worker's cluster client sends on a connection kept
        for them (:class:`~riverbed.bus.connection.Cluster`)."""
        raw = self._raw
        if renewal and isinstance(raw, Cluster):
            opened: RawPipeline | ClusterPipeline = raw.pipeline(transaction=False, renewal=True)
        else:
            opened = raw.pipeline(transaction=False)
        async with opened as pipe:
            yield Pipeline(pipe, self.url)

    async def send(self, commands: Sequence[tuple[Arg, ...]], *, raise_on_error: bool = True) -> None:
        """Make ``commands`` (as Redis takes them) in one write; a command the server refuses
        raises, or with ``raise_on_error=False`` is left refused (one it would refuse again).

        On a standalone Redis they go in an exchange (a third less CPU than the client library's
        pipeline, its command stack and reply callbacks); on a cluster, or after a broken
        connection, in a pipeline, which sends them all again as the library's retry does."""
        if not commands:
            return
        if not self._cluster:
            try:
                async with self.exchange(*commands) as replies:
                    refused: rexc.ResponseError | None = None
                    if replies is not None:
                        for _ in commands:
                            try:
                                await replies.read()
                            except rexc.ResponseError as exc:
                                refused = refused or exc
                        if refused is not None and raise_on_error:
                            raise refused
                        return
            except UnavailableError:
                pass
        async with self.pipeline() as pipe:
            for command in commands:
                pipe.command(*command)
            await pipe.execute(raise_on_error=raise_on_error)

    def exchange(self, *commands: Sequence[Any]) -> Exchange:
        """:func:`riverbed.bus.exchange.exchange` on this client: ``async with`` it for the
        replies (``None`` on a cluster), its errors (those of the replies read in the block
        too) translated."""
        return exchange(self._raw, *commands, url=self.url)

    # --- server -----------------------------------------------------------------------------

    async def ping(self) -> bool:
        with translate(self.url):
            return bool(await self._raw.ping())

    async def time(self) -> float:
        """The server's clock in seconds (on a cluster: one node's)."""
        with translate(self.url):
            reply: Any = await self._raw.time()
        if isinstance(reply, dict):  # a cluster client answers per node
            reply = next(iter(reply.values()))
        seconds, micros = reply
        return int(seconds) + int(micros) / 1e6

    # --- strings ----------------------------------------------------------------------------

    async def set(self, key: str, value: Arg, *, nx: bool = False, px: int | None = None) -> bool:
        """Whether the value was set (False: ``nx`` and the key existed)."""
        with translate(self.url):
            return bool(await self._raw.set(key, value, nx=nx, px=px))

    async def incr(self, key: str) -> int:
        with translate(self.url):
            return int(await self._raw.incr(key))

    # --- hashes -----------------------------------------------------------------------------

    async def hget(self, key: str, field: str) -> bytes | None:
        with translate(self.url):
            return cast(bytes | None, await self._raw.hget(key, field))

    async def hmget(self, key: str, fields: Sequence[str]) -> list[bytes | None]:
        with translate(self.url):
            return cast(list[bytes | None], await self._raw.hmget(key, list(fields)))

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        with translate(self.url):
            return cast(dict[bytes, bytes], await self._raw.hgetall(key))

    async def hset(self, key: str, field: str, value: Arg) -> int:
        """How many fields were new (0: ``field`` was overwritten)."""
        with translate(self.url):
            return int(await self._raw.hset(key, field, value))

    async def hsetnx(self, key: str, field: str, value: Arg) -> bool:
        """Whether ``field`` was set (False: it existed)."""
        with translate(self.url):
            return bool(await self._raw.hsetnx(key, field, value))

    async def hexists(self, key: str, field: str) -> bool:
        with translate(self.url):
            return bool(await self._raw.hexists(key, field))

    # --- sorted sets ------------------------------------------------------------------------

    async def zrange(self, key: str, start: int = 0, end: int = -1) -> list[bytes]:
        """Members ``start``..``end`` (ranks, inclusive), lowest score first."""
        with translate(self.url):
            return cast(list[bytes], await self._raw.zrange(key, start, end))

    async def zrange_scores(self, key: str, start: int = 0, end: int = -1) -> list[tuple[bytes, float]]:
        """(member, score) pairs ``start``..``end`` (ranks, inclusive), lowest score first."""
        with translate(self.url):
            return cast(list[tuple[bytes, float]], await self._raw.zrange(key, start, end, withscores=True))

    async def zrange_down(self, key: str, top: float | str, *, count: int) -> list[tuple[bytes, float]]:
        """At most ``count`` (member, score) pairs scored ``top`` or lower, highest score first
        (``top`` ``"+inf"``: from the highest)."""
        with translate(self.url):
            got = await self._raw.zrevrangebyscore(key, top, "-inf", start=0, num=count, withscores=True)
        return cast(list[tuple[bytes, float]], got)

    async def zrange_up(self, key: str, top: float, *, count: int) -> list[bytes]:
        """At most ``count`` members scored ``top`` or lower, lowest score first."""
        with translate(self.url):
            return cast(list[bytes], await self._raw.zrangebyscore(key, "-inf", top, start=0, num=count))

    async def zmscore(self, key: str, members: Sequence[str]) -> list[float | None]:
        """The scores of ``members`` (None for one not in the set)."""
        if not members:
            return []
        with translate(self.url):
            return await self._raw.zmscore(key, list(members))

    # --- streams ----------------------------------------------------------------------------

    async def xlen(self, key: str) -> int:
        with translate(self.url):
            return int(await self._raw.xlen(key))

    async def xrange(self, key: str, min: str = "-", max: str = "+", count: int | None = None) -> list[StreamEntry]:
        with translate(self.url):
            return _entries(await self._raw.xrange(key, min, max, count=count))

    async def xdel(self, key: str, *ids: str) -> int:
        with translate(self.url):
            return int(await self._raw.xdel(key, *ids))

    async def xread(self, key: str, after: str, *, count: int, block: int | None = None) -> list[StreamEntry]:
        """Entries of ``key`` after ``after``, waiting up to ``block`` ms for one (none: no wait)."""
        with translate(self.url):
            return _stream_reply(await self._raw.xread({key: after}, count=count, block=block))

    async def xreadgroup(
        self, group: str, consumer: str, key: str, after: str, *, count: int, block: int | None = None
    ) -> list[StreamEntry]:
        """``after`` ``">"``: new entries for ``consumer`` (waiting up to ``block`` ms); an id:
        the consumer's own pending entries after it."""
        with translate(self.url):
            return _stream_reply(await self._raw.xreadgroup(group, consumer, {key: after}, count=count, block=block))

    async def xreadgroup_many(
        self, group: str, consumer: str, keys: Sequence[str], *, count: int, block: int | None = None, after: str = ">"
    ) -> dict[str, list[StreamEntry]]:
        """New entries (``>``) of several streams for ``consumer`` in one command, by key (a
        stream with none is absent; up to ``count`` of each, waiting up to ``block`` ms for
        one), or with ``after`` an id the consumer's own pending ones.  Its keys must share a
        slot on a cluster."""
        with translate(self.url):
            reply = await self._raw.xreadgroup(group, consumer, dict.fromkeys(keys, after), count=count, block=block)
        if not reply:
            return {}
        pairs = reply.items() if isinstance(reply, dict) else reply
        return {(key.decode() if isinstance(key, bytes) else key): _entries(entries) for key, entries in pairs}

    async def smembers(self, key: str) -> builtins.set[str]:
        with translate(self.url):
            members = await self._raw.smembers(key)
        return {m.decode() if isinstance(m, bytes) else str(m) for m in members}

    async def xack(self, key: str, group: str, *ids: str) -> int:
        with translate(self.url):
            return int(await self._raw.xack(key, group, *ids))

    async def xclaim(
        self,
        key: str,
        group: str,
        consumer: str,
        ids: Sequence[str],
        *,
        min_idle_ms: int = 0,
        idle_ms: int | None = None,
    ) -> list[StreamEntry]:
        """Give ``ids`` (those idle for ``min_idle_ms``) to ``consumer``, idle for ``idle_ms``
        from now (default 0); the entries claimed."""
        with translate(self.url):
            reply = await self._raw.xclaim(key, group, consumer, min_idle_ms, list(ids), idle=idle_ms)
        return _entries(reply)

    async def xclaim_ids(
        self, key: str, group: str, consumer: str, ids: Sequence[str], *, idle_ms: int | None = None
    ) -> list[bytes]:
        """:meth:`xclaim` that answers the ids claimed only (``JUSTID``: delivery count untouched)."""
        with translate(self.url):
            reply = await self._raw.xclaim(key, group, consumer, 0, list(ids), idle=idle_ms, justid=True)
        return cast(list[bytes], reply)

    async def xpending_range(
        self,
        key: str,
        group: str,
        *,
        min: str = "-",
        max: str = "+",
        count: int,
        consumer: str | None = None,
        idle_ms: int | None = None,
    ) -> list[PendingEntry]:
        """The first ``count`` pending entries (of ``consumer``; idle for ``idle_ms``) between ``min``
        and ``max``: with ``idle_ms`` the whole list is scanned for them in one command."""
        with translate(self.url):
            reply = await self._raw.xpending_range(key, group, min, max, count, consumername=consumer, idle=idle_ms)
        return cast(list[PendingEntry], reply)

    async def xgroup_create(self, key: str, group: str, after: str, *, mkstream: bool = True) -> bool:
        """Create ``group`` on ``key``, delivering entries after ``after``; False (nothing
        changed) when the group exists."""
        with translate(self.url):
            try:
                await self._raw.xgroup_create(key, group, id=after, mkstream=mkstream)
            except rexc.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
                return False
        return True

    async def xgroup_setid(self, key: str, group: str, after: str) -> None:
        with translate(self.url):
            await self._raw.xgroup_setid(key, group, id=after)

    async def xinfo_groups(self, key: str) -> list[GroupInfo]:
        """The groups of ``key``; a missing key raises ``ResponseError`` ("no such key")."""
        with translate(self.url):
            return cast(list[GroupInfo], await self._raw.xinfo_groups(key))


class Script:
    """A registered Lua script; calling it runs ``EVALSHA`` (loading it on ``NOSCRIPT``)."""

    def __init__(self, script: AsyncScript, url: str) -> None:
        self._script = script
        self._url = url
        self._loaded = False
        self._loading: anyio.Event | None = None
        """Set when the load under way ends (whether or not it loaded the script)."""

    @property
    def sha(self) -> str:
        return self._script.sha

    async def __call__(self, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """The script's reply, as Lua returned it (riverbed's scripts document theirs)."""
        with translate(self._url):
            return await self._script(keys=list(keys), args=list(args))

    async def load(self) -> None:
        """Load the script into the server's cache once, before ``EVALSHA`` goes out by itself
        (in an exchange, which cannot load it on ``NOSCRIPT``): a thousand first callers at once
        wait for one ``SCRIPT LOAD`` instead of each failing and starting over.  A server that
        lost its cache later answers ``NOSCRIPT`` again, and the caller runs the script alone."""
        while not self._loaded:
            if self._loading is not None:
                # Another caller is loading it: every waiter goes on in the same turn once it
                # ends (a lock would let one go on a turn); after a failure, one tries again.
                await self._loading.wait()
                continue
            self._loading = anyio.Event()
            try:
                with translate(self._url):
                    await self._script.registered_client.script_load(self._script.script)
                self._loaded = True
            finally:
                done, self._loading = self._loading, None
                done.set()


class Reply(Generic[T]):
    """The reply of a command queued in a :class:`Pipeline`, there once the pipeline ran."""

    def __init__(self) -> None:
        self._value: Any = _UNSET
        self.error: Exception | None = None
        """The server's error for this command (kept with ``raise_on_error=False``)."""

    @property
    def value(self) -> T:
        """The reply; the command's :attr:`error` raises."""
        if self.error is not None:
            raise self.error
        if self._value is _UNSET:
            raise RuntimeError("a pipelined reply was read before the pipeline ran")
        return cast(T, self._value)


class Pipeline:
    """Commands queued for one round trip; each queuing returns the command's :class:`Reply`,
    filled in by :meth:`execute`."""

    def __init__(self, pipe: RawPipeline | ClusterPipeline, url: str) -> None:
        self._pipe = pipe
        self._url = url
        self._replies: list[Reply[Any]] = []

    async def execute(self, *, raise_on_error: bool = True) -> None:
        """Send the commands and fill in their replies.  A command's server error raises
        (the first one, as the server said it: redis-py's own raise would prefix it with the
        command's place, and ``NOGROUP`` would no longer read as a lost group), or with
        ``raise_on_error=False`` is kept as its reply's ``error``."""
        with translate(self._url):
            results = await self._pipe.execute(raise_on_error=False)
            for reply, result in zip(self._replies, results, strict=True):
                if isinstance(result, Exception):
                    reply.error = result
                else:
                    reply._value = result
            if raise_on_error:
                for result in results:
                    if isinstance(result, Exception):
                        raise result

    def _queued(self) -> Reply[Any]:
        reply = Reply[Any]()
        self._replies.append(reply)
        return reply

    def command(self, *args: Arg) -> Reply[Any]:
        """Any command as Redis takes it (a held write, ``SessionContext.ack_with_read``); its raw reply."""
        self._pipe.execute_command(*args)
        return self._queued()

    def evalsha(self, sha: str, keys: Sequence[str], args: Sequence[Arg]) -> Reply[Any]:
        """A script already loaded (:meth:`RedisClient.script_load`); ``NOSCRIPT`` otherwise."""
        self._pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        return self._queued()

    def get(self, key: str) -> Reply[bytes | None]:
        self._pipe.get(key)
        return self._queued()

    def set(self, key: str, value: Arg, *, ex: int | None = None) -> Reply[bool]:
        self._pipe.set(key, value, ex=ex)
        return self._queued()

    def delete(self, *keys: str) -> Reply[int]:
        self._pipe.delete(*keys)
        return self._queued()

    def hget(self, key: str, field: str) -> Reply[bytes | None]:
        self._pipe.hget(key, field)
        return self._queued()

    def hmget(self, key: str, fields: Sequence[str]) -> Reply[list[bytes | None]]:
        self._pipe.hmget(key, list(fields))
        return self._queued()

    def zadd(self, key: str, scores: Mapping[str, float], *, nx: bool = False) -> Reply[int]:
        self._pipe.zadd(key, dict(scores), nx=nx)
        return self._queued()

    def hset(
        self, key: str, field: str | None = None, value: Arg | None = None, *, mapping: Mapping[str, Arg] | None = None
    ) -> Reply[int]:
        """One field (``field``, ``value``) or several (``mapping``)."""
        fields: dict[Any, Any] | None = dict(mapping) if mapping is not None else None
        self._pipe.hset(key, field, value, mapping=fields)
        return self._queued()

    def hdel(self, key: str, *fields: str) -> Reply[int]:
        self._pipe.hdel(key, *fields)
        return self._queued()

    def zrem(self, key: str, *members: str) -> Reply[int]:
        self._pipe.zrem(key, *members)
        return self._queued()

    def xadd(self, key: str, fields: Mapping[str, Arg]) -> Reply[bytes]:
        """Its reply: the new entry's id."""
        entry: dict[EncodableT, EncodableT] = dict(fields.items())
        self._pipe.xadd(key, entry)
        return self._queued()

    def sadd(self, key: str, *members: str) -> Reply[int]:
        self._pipe.sadd(key, *members)
        return self._queued()

    def xack(self, key: str, group: str, *ids: str) -> Reply[int]:
        self._pipe.xack(key, group, *ids)
        return self._queued()

    def xdel(self, key: str, *ids: str) -> Reply[int]:
        self._pipe.xdel(key, *ids)
        return self._queued()

    def xrevrange(self, key: str, *, count: int) -> Reply[list[StreamEntry]]:
        """Its reply: the last ``count`` entries, newest first."""
        self._pipe.xrevrange(key, count=count)
        return self._queued()

    def xrange(self, key: str, *, count: int) -> Reply[list[StreamEntry]]:
        """Its reply: the first ``count`` entries, oldest first."""
        self._pipe.xrange(key, count=count)
        return self._queued()

    def xclaim_ids(self, key: str, group: str, consumer: str, ids: Sequence[str]) -> Reply[list[bytes]]:
        self._pipe.xclaim(key, group, consumer, 0, list(ids), justid=True)
        return self._queued()

    def xinfo_groups(self, key: str) -> Reply[list[GroupInfo]]:
        self._pipe.xinfo_groups(key)
        return self._queued()

    def xpending(self, key: str, group: str) -> Reply[PendingSummary]:
        self._pipe.xpending(key, group)
        return self._queued()

    def xpending_range(self, key: str, group: str, *, count: int) -> Reply[list[PendingEntry]]:
        """Its reply: the first ``count`` pending entries."""
        self._pipe.xpending_range(key, group, min="-", max="+", count=count)
        return self._queued()


def as_client(redis: RedisClient | RawClient, url: str = "redis") -> RedisClient:
    """``redis`` itself, or the redis-py client ``redis`` wrapped (errors naming ``url``)."""
    return redis if isinstance(redis, RedisClient) else RedisClient(redis, url)


def _entries(reply: Any) -> list[StreamEntry]:
    """Entries as redis-py parses them (it gives an entry deleted while pending empty fields)."""
    return list(reply or ())


def _stream_reply(reply: Any) -> list[StreamEntry]:
    """The entries of an ``XREAD``/``XREADGROUP`` reply on one stream (RESP2 or RESP3)."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else (entries for _key, entries in reply)
    return [entry for entries in streams for entry in _entries(entries)]

"""Wake-ups: one subscribed connection per Redis node tells a worker's session loops that their
logs moved, so no loop holds a connection of its own while it waits.

The append script publishes the log's new last id on the session's shard channel
(``SPUBLISH {p}:{s}:wake``, in the session's own slot, so on a cluster it goes to the node that
holds the log), followed by the roles whose loops have nothing to read in that append: the role
whose group the append moved past its own events, and the runtime role unless the append holds
something it acts on (``"12 agent runtime"``).  So the runtime role's loops are not woken by the
events they have no use for (the observations they write, messages, the other roles' events).
A wake-up from an older append script names no roles and rings every loop, as it always did.
A worker subscribes (``SSUBSCRIBE``) to the channels of the sessions it owns, on one
connection per node that serves them, and rings each session's :class:`Bell`; the session
loops then read without blocking (``XREADGROUP`` with no ``BLOCK``) on the worker's
shared, bounded connection pool.

Pub/Sub delivers at most once: a message sent while a feed reconnects is lost.  So every
feed that (re)connects rings every bell it serves (each loop reads once more), and a loop that
hears nothing still reads now and then (``SessionLoop`` does, with its stray check, at most
30 s apart): a lost wake-up costs at most those seconds, never a stuck session.  On a cluster, a feed whose node
stops answering, refuses a channel (``MOVED``) or gives a channel up (a slot migrated) makes
the worker reload the slot map and place every channel again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import hiredis
import redis.asyncio as aioredis
import redis.exceptions as rexc
import structlog
from anyio.abc import TaskGroup, TaskStatus
from redis.asyncio.cluster import RedisCluster

from riverbed.bus._redispy import socket_stream
from riverbed.bus.backoff import Backoff
from riverbed.bus.connection import RawClient
from riverbed.bus.keys import Keys

__all__ = ["Bell", "Wakeups"]

log = structlog.get_logger("riverbed.worker")

#: A feed that heard nothing for this long pings its node; one that hears nothing (not even
#: the pong) for three times as long is taken for dead and reconnects.
PING_SECONDS = 5.0
#: How long :meth:`Wakeups.watch` waits for the subscription's confirmation before the loop
#: goes on anyway (it still reads with its stray checks: a second after it took the session, then
#: ever less often).
CONFIRM_SECONDS = 1.0
#: How much a feed reads from its socket at once.
_CHUNK = 1 << 16
#: What the parser says when a message is not all there yet.
_MORE = object()


class Bell:
    """Rings when a session's log may have moved for one role's loop, which keeps its mark."""

    __slots__ = ("_waiters", "news", "role", "rung")

    def __init__(self, role: str) -> None:
        self.role = role
        self.rung = 0
        self.news: int | None = None
        """The log's last id that the latest ring brought, if it brought one (a feed that
        reconnected rings without: then anything may have moved)."""
        self._waiters: list[asyncio.Future[None]] = []
        """One future per task waiting: a loop busy with work waits on none, and its wake-ups
        cost nothing.  Futures and a timer, not an event in a cancel scope with a deadline:
        every action's loop waits once, and those cost several times as much."""

    def ring(self, news: int | None = None) -> None:
        self.rung += 1
        self.news = news
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                _wake(waiter)

    async def wait(self, mark: int, timeout: float) -> bool:
        """Wait until the bell rang after ``mark`` (a value of :attr:`rung`), for at most
        ``timeout`` seconds; whether it did."""
        if self.rung != mark:
            return True
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            if waiter in self._waiters:  # (timed out or cancelled: not rung)
                self._waiters.remove(waiter)
        return self.rung != mark


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass
class _Watched:
    bells: list[Bell] = field(default_factory=list)
    confirmed: anyio.Event = field(default_factory=anyio.Event)


class _Feed:
    """One subscribed connection to one node, reading its messages in a task of its own.

    Other tasks write to it (``SSUBSCRIBE``) while the reader waits; they send without redis-py's
    health check, which would read a reply from under the reader.  The channels subscribed in
    one turn go in one write (a burst of sessions taken at once subscribes side by side).
    """

    def __init__(self, wakeups: Wakeups, node: str, connection: Any) -> None:
        self.wakeups = wakeups
        self.node = node
        self.connection = connection
        self.channels: set[str] = set()
        self.scope = anyio.CancelScope()
        self.live = False
        self.retired = False
        """Replaced on purpose (every channel is being placed again): its end asks for nothing."""
        self._queued: list[str] = []
        """Channels to subscribe to in the write the first of them sends at the end of this turn."""

    async def run(self) -> None:
        with self.scope:
            try:
                await self.connection.connect()
                self.live = True
                await self._send("SSUBSCRIBE", sorted(self.channels))
                for channel in self.channels:
                    self.wakeups.ring(channel)  # anything published while this feed was away
                await self._read()
            except (rexc.RedisError, OSError) as exc:
                log.warning("wakeups.feed_lost", node=self.node, error=str(exc))
            finally:
                self.live = False
                with anyio.CancelScope(shield=True):
                    await self.connection.disconnect()
                self.wakeups.feed_ended(self)

    async def subscribe(self, channel: str) -> None:
        self.channels.add(channel)
        if not self.live:
            return  # subscribed to when the feed connects
        self._queued.append(channel)
        if len(self._queued) > 1:
            return  # the first channel queued in this turn sends this one too
        try:
            with anyio.CancelScope(shield=True):
                await anyio.lowlevel.checkpoint()  # the loops taking sessions in this turn queue theirs
        finally:
            queued, self._queued = self._queued, []
        if self.live:
            await self._send("SSUBSCRIBE", queued)

    async def _send(self, command: str, channels: list[str]) -> None:
        """``command`` for each channel, all in one write (one channel each: on a cluster a
        command's channels must share a slot)."""
        if channels:
            lines: list[tuple[Any, ...]] = [(command, channel) for channel in channels]
            packed = b"".join(hiredis.pack_command(line) for line in lines)
            await self.connection.send_packed_command(packed, check_health=False)

    async def unsubscribe(self, channel: str) -> None:
        self.channels.discard(channel)
        if self.live:
            await self.connection.send_command("SUNSUBSCRIBE", channel, check_health=False)

    async def _read(self) -> None:
        """Read the connection's messages a chunk at a time and handle every message in it.

        The feed owns its connection's incoming bytes (other tasks only write to it), so it
        parses them itself: a chunk that brings a hundred wake-ups costs one wait, not a hundred
        trips through the client's reply machinery.  Liveness is checked per window of
        ``PING_SECONDS``, not per message: a window that heard nothing sends a PING, and three
        such windows in a row mean the node is gone."""
        stream = socket_stream(self.connection)
        parser = hiredis.Reader(notEnoughData=_MORE)
        quiet = 0
        while True:
            heard = False
            with anyio.move_on_after(PING_SECONDS):
                while True:
                    chunk = await stream.read(_CHUNK)
                    if not chunk:
                        raise rexc.ConnectionError(f"{self.node} closed the wake-up connection")
                    heard = True
                    parser.feed(chunk)
                    while (message := parser.gets()) is not _MORE:
                        self._handle(message)
            if heard:
                quiet = 0
                continue
            quiet += 1
            if quiet >= 3:
                raise rexc.ConnectionError(f"no reply from {self.node} for {3 * PING_SECONDS:.0f}s")
            await self.connection.send_command("PING", check_health=False)

    def _handle(self, message: Any) -> None:
        if isinstance(message, Exception):  # an error reply (hiredis hands it over, not raised)
            raise rexc.ResponseError(str(message))
        if not isinstance(message, list) or len(message) < 2:
            return  # a PONG
        kind = message[0]
        channel = _text(message[1])
        if kind == b"smessage":
            # "<last id>", then the roles whose loops have nothing to read in the append (one
            # whose group was moved past it; the runtime, for what it does not act on).
            last, _sep, skip = _text(message[2]).partition(" ")
            self.wakeups.ring(channel, skip=skip.split(), news=int(last) if last.isdigit() else None)
        elif kind == b"ssubscribe":
            self.wakeups.confirmed(channel)
        elif kind == b"sunsubscribe" and channel in self.channels:
            # The node gave up a channel we still want: its slot moved elsewhere.
            raise rexc.ConnectionError(f"the node gave up channel {channel} (its slot moved)")


class Wakeups:
    """The wake-up feeds of one worker: :meth:`watch` a session, wait on its :class:`Bell`."""

    def __init__(self, redis: RawClient, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._watched: dict[str, _Watched] = {}
        self._feeds: dict[str, _Feed] = {}
        self._tg: TaskGroup | None = None
        self._replace = anyio.Event()

    @property
    def connections(self) -> int:
        """The subscribed connections open now (one per node serving a watched session)."""
        return sum(1 for feed in self._feeds.values() if feed.live)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            backoff = Backoff(first=0.1, cap=2.0)
            while True:
                await self._replace.wait()
                self._replace = anyio.Event()
                await backoff.pause()  # a node that just failed: give the cluster a moment
                try:
                    await self._place_all()
                except (rexc.RedisError, OSError) as exc:
                    log.warning("wakeups.replace_failed", error=str(exc), retry_in=backoff.next)
                    self._replace.set()
                    continue
                backoff.reset()

    async def watch(self, session: str, role: str) -> Bell:
        """Subscribe to ``session``'s wake-ups (once per worker, however many roles watch it) and
        wait, briefly, for the subscription to hold; the bell of ``role``'s loop."""
        channel = self.keys.wake(session)
        watched = self._watched.get(channel)
        new = watched is None
        if watched is None:
            watched = self._watched[channel] = _Watched()
        bell = Bell(role)
        watched.bells.append(bell)
        if watched.confirmed.is_set():
            return bell  # (a session watched already: at once, no turn given up)
        try:
            if new:
                await self._subscribe(channel)
            with anyio.move_on_after(CONFIRM_SECONDS):
                await watched.confirmed.wait()
        except BaseException:
            # Cancelled (or failed) on the way: nothing is left watching for it.
            with anyio.CancelScope(shield=True):
                await self.unwatch(session, bell)
            raise
        return bell

    def confirmed_for(self, session: str) -> bool:
        """Whether ``session``'s subscription holds (Redis confirmed it): every wake-up since reaches it."""
        watched = self._watched.get(self.keys.wake(session))
        return watched is not None and watched.confirmed.is_set()

    def release(self, session: str, bell: Bell) -> bool:
        """Let ``bell`` go at once when another bell still watches ``session`` (its subscription
        stays): whether it did.  When it did not, :meth:`unwatch` does it all."""
        watched = self._watched.get(self.keys.wake(session))
        if watched is None or bell not in watched.bells or len(watched.bells) == 1:
            return False
        watched.bells.remove(bell)
        return True

    async def unwatch(self, session: str, bell: Bell) -> None:
        channel = self.keys.wake(session)
        watched = self._watched.get(channel)
        if watched is None or bell not in watched.bells:
            return
        watched.bells.remove(bell)
        if watched.bells:
            return
        del self._watched[channel]
        for feed in list(self._feeds.values()):
            if channel not in feed.channels:
                continue
            if feed.channels == {channel}:
                # Its last channel: close the feed (a node serving none of our sessions costs nothing).
                feed.channels.clear()
                feed.retired = True
                feed.scope.cancel()
                del self._feeds[feed.node]
                continue
            try:
                await feed.unsubscribe(channel)
            except (rexc.RedisError, OSError):
                feed.scope.cancel()  # it reconnects with the channels it should have

    def ring(self, channel: str, *, skip: Sequence[str] = (), news: int | None = None) -> None:
        """Ring the bells of ``channel``'s session, but those of the roles in ``skip`` (nothing
        new for them); ``news``: the log's last id, where the wake-up said."""
        watched = self._watched.get(channel)
        if watched is not None:
            for bell in watched.bells:
                if bell.role not in skip:
                    bell.ring(news)

    def ring_all(self) -> None:
        """Ring every watched session's bell (its loops look at the log, and whether to stop, now)."""
        for watched in self._watched.values():
            for bell in watched.bells:
                bell.ring()

    def confirmed(self, channel: str) -> None:
        watched = self._watched.get(channel)
        if watched is not None:
            watched.confirmed.set()

    def feed_ended(self, feed: _Feed) -> None:
        if self._feeds.get(feed.node) is feed:
            del self._feeds[feed.node]
        if not feed.retired and any(channel in self._watched for channel in feed.channels):
            self._replace.set()

    async def _subscribe(self, channel: str) -> None:
        node, make = self._node_of(channel)
        feed = self._feeds.get(node)
        if feed is None:
            feed = self._feeds[node] = _Feed(self, node, make())
            feed.channels.add(channel)
            assert self._tg is not None, "Wakeups.run() is not running"
            self._tg.start_soon(feed.run)
            return
        try:
            await feed.subscribe(channel)
        except (rexc.RedisError, OSError):
            feed.scope.cancel()  # reconnects (through feed_ended) with this channel too

    async def _place_all(self) -> None:
        """Place every watched channel on the feed of the node that serves it now."""
        if isinstance(self.redis, RedisCluster):
            await self.redis.nodes_manager.initialize()
        for feed in list(self._feeds.values()):
            feed.retired = True
            feed.scope.cancel()
        self._feeds.clear()
        for channel in list(self._watched):
            await self._subscribe(channel)

    def _node_of(self, channel: str) -> tuple[str, Any]:
        """The name of the node serving ``channel`` and how to open a connection to it."""
        if isinstance(self.redis, aioredis.Redis):
            pool = self.redis.connection_pool
            return "standalone", lambda: pool.connection_class(**pool.connection_kwargs)
        node = self.redis.nodes_manager.get_node_from_slot(self.redis.keyslot(channel))
        return node.name, lambda: node.connection_class(**node.connection_kwargs)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

"""Commands of many sessions' loops in one round trip: the loops woken in the same turn go together.

An owned session's loop reads its log without blocking when its wake-up rings, and sends the
answer it holds on its own when no blocking read can carry it (``bus/session_loop.py``).  A
worker with hundreds of busy sessions has many bells ringing in one turn of the event loop,
and each command alone costs a turn of the connection pool, a write, a reply and its parse.
A :class:`Gather` lets the first loop to ask lead: it yields once, so the loops woken with it
join, then sends everybody's commands in one write and hands each loop its own reply.

- :class:`GroupedReads`: one ``XREADGROUP GROUP <role> <worker> COUNT n STREAMS k1 k2 … > > …``
  for every session that joined (``COUNT`` applies per stream);
- :class:`GroupedAnswers`: the answers' append scripts in one write (``bus/exchange.py``),
  each reply read in turn;
- :class:`GroupedPending`: the loops' periodic checks for entries left pending with nobody
  working on them, one ``XPENDING <log> <role>`` each in one write;
- :class:`Batched`: single commands of any kind, each with its own reply, in one write: the
  steps of taking a session (acquire it, make its log's group, read the fold saved for it and
  the log after it, look for entries in flight), which a burst of new sessions takes side by
  side.

Only on a standalone Redis: a cluster command's keys must share a slot, and sessions spread
over the slots, so there each loop sends its own.  Whatever goes wrong with a grouped round
trip (one log whose group is gone fails a whole grouped read with ``NOGROUP``; a connection
breaks), each loop it concerned does its own command alone and meets its own outcome, which
its loop knows how to handle (rebuild its group, back off, retry under the same idempotency key).
A read whose grouped round trip failed may have delivered entries whose reply nobody got: its
loop is told, and looks for such strays at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel
import redis.exceptions as rexc

from riverbed.bus.connection import translate
from riverbed.bus.exchange import stream_entries, stream_entries_by_key, written
from riverbed.bus.log import PreparedAppend
from riverbed.bus.redis_client import Arg, PendingEntry, RedisClient, Script, StreamEntry

__all__ = ["Batched", "Gather", "GroupedAnswers", "GroupedPending", "GroupedReads"]

#: How long the leader of a grouped round trip waits for its replies, shielded from its own
#: cancellation (the loops that joined it wait for theirs), before every one of them goes alone.
LEAD_TIMEOUT_SECONDS = 5.0

T = TypeVar("T")
R = TypeVar("R")


class _Alone:
    """The reply slot of a command that must go alone (a lone item, a cluster client's, one of a
    leader cancelled before it sent, one the group's command cannot carry)."""


class _Lost(_Alone):
    """The reply slot of a command whose grouped round trip failed: it goes alone, and what the
    round trip did (it may have reached Redis) is not known."""


ALONE = _Alone()
LOST = _Lost()


class _Gathering(Generic[T, R]):
    """The items asked for in one turn, their replies once sent, and a future for each caller
    (all but the leader) to wait on: a caller cancelled meanwhile cancels only its own."""

    __slots__ = ("items", "replies", "waiters")

    def __init__(self, item: T) -> None:
        self.items: list[T] = [item]
        self.replies: Sequence[R | _Alone] = ()
        self.waiters: list[asyncio.Future[None]] = []

    def reply(self, index: int) -> R | _Alone:
        return self.replies[index] if index < len(self.replies) else ALONE

    def settle(self) -> None:
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)


class Gather(Generic[T, R]):
    """Items asked for in the same turn of the event loop, sent by ``send`` in one round trip.

    ``send`` gets the items (two or more) and returns one reply per item, in order: a value, or
    :data:`ALONE` for an item whose caller must do its command alone.  A lone item is never
    sent: :meth:`join` answers :data:`ALONE` and its caller goes alone at once, as every caller
    does on a cluster client (``client.cluster``).
    """

    def __init__(self, client: RedisClient, send: Callable[[list[T]], Awaitable[Sequence[R | _Alone]]]) -> None:
        self._grouping = not client.cluster
        self._send = send
        self._gathering: _Gathering[T, R] | None = None
        self.round_trips = 0
        """Grouped round trips sent (each for two or more items)."""
        self.items = 0
        """Items those round trips carried."""

    async def join(self, item: T) -> R | _Alone:
        if not self._grouping:
            return ALONE
        gathering = self._gathering
        if gathering is not None:
            index = len(gathering.items)
            gathering.items.append(item)
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            gathering.waiters.append(waiter)
            await waiter
            return gathering.reply(index)
        gathering = self._gathering = _Gathering(item)
        try:
            await anyio.lowlevel.checkpoint()  # the loops woken in this turn run now, and join
        except BaseException:  # the leader was cancelled: the others go alone
            gathering.settle()
            raise
        finally:
            self._gathering = None
        if len(gathering.items) > 1:
            with anyio.CancelScope(shield=True):
                await self._lead(gathering)
        return gathering.reply(0)

    async def _lead(self, gathering: _Gathering[T, R]) -> None:
        self.round_trips += 1
        self.items += len(gathering.items)
        try:
            with anyio.fail_after(LEAD_TIMEOUT_SECONDS):
                gathering.replies = await self._send(list(gathering.items))
        except Exception:  # every caller goes alone and meets its own outcome
            gathering.replies = [LOST] * len(gathering.items)
        finally:
            gathering.settle()


class GroupedReads:
    """New entries of one role's sessions, read together when their loops ask together.

    A loop's held writes (``SessionContext.ack_with_read``: the agent role's acknowledgements
    and run summaries) go in the same write, before the read."""

    def __init__(self, client: RedisClient, group: str, consumer: str, count: int) -> None:
        self._client = client
        self._group = group
        self._consumer = consumer
        self._count = count
        self.gather: Gather[tuple[str, Sequence[tuple[Arg, ...]]], list[StreamEntry]] = Gather(client, self._send)

    async def read(
        self, key: str, writes: Sequence[tuple[Arg, ...]] = (), *, lost: Callable[[], None] | None = None
    ) -> list[StreamEntry]:
        """The new entries of the log at ``key`` for this owner (none waited for), after ``writes``;
        ``lost()`` is called when a grouped read that carried it failed: it may have delivered
        entries whose reply nobody got (they are pending with nobody working on them), and the
        entries are read alone."""
        got = await self.gather.join((key, writes))
        if not isinstance(got, _Alone):
            return got
        if isinstance(got, _Lost) and lost is not None:
            lost()
        if writes:
            read = ("XREADGROUP", "GROUP", self._group, self._consumer, "COUNT", self._count, "STREAMS", key, ">")
            reply = await _after_writes(self._client, writes, read)
            if not isinstance(reply, _Alone):
                return stream_entries(reply)
            await self._client.send(writes, raise_on_error=False)  # (a cluster: their keys may be anywhere)
        return await self._client.xreadgroup(self._group, self._consumer, key, ">", count=self._count)

    async def _send(self, items: list[tuple[str, Sequence[tuple[Arg, ...]]]]) -> list[list[StreamEntry] | _Alone]:
        keys = [key for key, _writes in items]
        if len(set(keys)) < len(keys):  # one loop per session: never expected, never wrong
            return [ALONE] * len(keys)
        writes = [command for _key, held in items for command in held]
        read: tuple[Arg, ...] = ("XREADGROUP", "GROUP", self._group, self._consumer, "COUNT", self._count, "STREAMS")
        got = await _after_writes(self._client, writes, (*read, *keys, *(">",) * len(keys)))
        if isinstance(got, _Alone):
            return [ALONE] * len(keys)
        by_key = dict(stream_entries_by_key(got))
        return [by_key.get(key.encode(), []) for key in keys]


class GroupedAnswers:
    """Answers' append scripts of one role's sessions, sent together when their loops send
    together, each after the writes its loop held for it (``SessionContext.ack_with_read``)."""

    def __init__(self, client: RedisClient) -> None:
        self._client = client
        self.gather: Gather[tuple[PreparedAppend, Sequence[tuple[Arg, ...]]], Any] = Gather(client, self._send)

    async def reply(self, prepared: PreparedAppend, writes: Sequence[tuple[Arg, ...]] = ()) -> Any:
        """The script's raw reply, or :data:`ALONE`: the caller runs ``prepared`` alone (its
        idempotency key makes that safe even if the grouped write reached Redis), and sends
        ``writes`` again (they were made, or not)."""
        return await self.gather.join((prepared, writes))

    async def _send(self, items: list[tuple[PreparedAppend, Sequence[tuple[Arg, ...]]]]) -> list[Any]:
        await items[0][0].log.append_script.load()
        return await _each_after_writes(self._client, [(writes, prepared.command) for prepared, writes in items])


class GroupedPending:
    """How many entries of a session's log are pending for one role, asked together when the
    loops check together (each check otherwise costs a detailed ``XPENDING`` of its own), each
    after the writes its loop held (its acknowledgements: what it handled is not pending)."""

    def __init__(self, client: RedisClient, group: str) -> None:
        self._client = client
        self._group = group
        self.gather: Gather[tuple[str, Sequence[tuple[Arg, ...]]], int] = Gather(client, self._send)

    async def count(self, key: str, writes: Sequence[tuple[Arg, ...]] = ()) -> int:
        """How many entries of the log at ``key`` are pending (alone on a cluster: 0 or 1), after ``writes``."""
        got = await self.gather.join((key, writes))
        if not isinstance(got, _Alone):
            return got
        if writes:
            reply = await _after_writes(self._client, writes, ("XPENDING", key, self._group))
            if not isinstance(reply, _Alone):
                return int(reply[0])
            await self._client.send(writes, raise_on_error=False)  # (a cluster: their keys may be anywhere)
        return len(await self._client.xpending_range(key, self._group, min="-", max="+", count=1))

    async def _send(self, items: list[tuple[str, Sequence[tuple[Arg, ...]]]]) -> list[int | _Alone]:
        replies = await _each_after_writes(
            self._client, [(writes, ("XPENDING", key, self._group)) for key, writes in items]
        )
        return [ALONE if isinstance(reply, _Alone) else int(reply[0]) for reply in replies]


async def _after_writes(client: RedisClient, writes: Sequence[tuple[Arg, ...]], command: tuple[Arg, ...]) -> Any:
    """``command``'s raw reply, sent in one write after held ``writes`` (their refusals ignored:
    the server would refuse them again); :data:`ALONE` on a cluster, where nothing was sent."""
    async with client.exchange(*writes, command) as replies:
        if replies is None:
            return ALONE
        await written(replies, len(writes))
        return await replies.read()


async def _each_after_writes(
    client: RedisClient, items: Sequence[tuple[Sequence[tuple[Arg, ...]], tuple[Arg, ...]]]
) -> list[Any]:
    """Each item's command after its writes, all in one write: the commands' replies, in order
    (:func:`_exchanged`'s, the writes' left out)."""
    replies = await _exchanged(client, [command for writes, last in items for command in (*writes, last)])
    out: list[Any] = []
    at = -1
    for writes, _command in items:
        at += len(writes) + 1
        out.append(replies[at])
    return out


class _Refused:
    """The reply slot of a command the server refused with an error."""

    __slots__ = ("error",)

    def __init__(self, error: rexc.ResponseError) -> None:
        self.error = error


class Batched:
    """The few commands of taking a session, sent with the same commands of the other loops
    asked in the same turn; each method answers as :class:`RedisClient`'s of the same name (a
    command that cannot go with others goes alone through the client).

    One write carries all of them and each caller gets its own reply or its own error, so a
    thousand sessions taken at once cost a handful of writes per step instead of a thousand.
    """

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self.gather: Gather[tuple[Arg, ...], Any] = Gather(client, self._send)

    async def _call(self, *command: Arg) -> Any:
        """The raw reply of ``command`` sent with the others asked in this turn, or
        :data:`ALONE` (send it yourself: also when the round trip failed, :data:`LOST`; these
        commands are safe to send again); the server's error raises (translated)."""
        got = await self.gather.join(command)
        if isinstance(got, _Refused):
            with translate(self.client.url):
                raise got.error
        return ALONE if isinstance(got, _Alone) else got

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """``script``'s reply (see :meth:`Script.__call__`)."""
        await script.load()
        try:
            got = await self._call("EVALSHA", script.sha, len(keys), *keys, *args)
        except rexc.NoScriptError:  # the server lost its scripts: the script's own call loads it
            got = ALONE
        return await script(keys, args) if got is ALONE else got

    async def hget(self, key: str, field: str) -> bytes | None:
        got = await self._call("HGET", key, field)
        return await self.client.hget(key, field) if got is ALONE else got

    async def xgroup_create(self, key: str, group: str, after: str) -> bool:
        """Create ``group`` on ``key`` (and the stream), delivering after ``after``; False when
        the group exists."""
        try:
            got = await self._call("XGROUP", "CREATE", key, group, after, "MKSTREAM")
        except rexc.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False
        return await self.client.xgroup_create(key, group, after) if got is ALONE else True

    async def xrange(self, key: str, min: str = "-", max: str = "+", count: int | None = None) -> list[StreamEntry]:
        command: tuple[Arg, ...] = ("XRANGE", key, min, max) + (("COUNT", count) if count is not None else ())
        got = await self._call(*command)
        if got is ALONE:
            return await self.client.xrange(key, min, max, count)
        return [(raw_id, _fields(flat)) for raw_id, flat in got]

    async def xpending_range(
        self, key: str, group: str, *, min: str = "-", max: str = "+", count: int
    ) -> list[PendingEntry]:
        got = await self._call("XPENDING", key, group, min, max, count)
        if got is ALONE:
            return await self.client.xpending_range(key, group, min=min, max=max, count=count)
        return [
            PendingEntry(message_id=raw_id, consumer=consumer, time_since_delivered=int(idle), times_delivered=int(n))
            for raw_id, consumer, idle, n in got
        ]

    async def _send(self, commands: list[tuple[Arg, ...]]) -> list[Any]:
        return await _exchanged(self.client, commands, refused=_Refused)


def _fields(flat: Any) -> dict[bytes, bytes]:
    """An entry's fields from the flat list (RESP2) or map (RESP3) Redis sends."""
    if isinstance(flat, dict):
        return flat
    return dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}


async def _exchanged(
    client: RedisClient,
    commands: Sequence[tuple[Any, ...]],
    *,
    refused: Callable[[rexc.ResponseError], Any] | None = None,
) -> list[Any]:
    """The replies of ``commands`` sent in one write; :data:`ALONE` for every command on a
    cluster, and for a command whose reply was an error unless ``refused`` makes that error
    its reply (else its caller runs it alone and sees the error itself).  A broken connection
    raises (every caller then goes alone)."""
    replies: list[Any] = [ALONE] * len(commands)
    async with client.exchange(*commands) as exchanged:
        if exchanged is None:
            return replies
        for index in range(len(commands)):
            try:
                replies[index] = await exchanged.read()
            except rexc.ResponseError as exc:
                replies[index] = ALONE if refused is None else refused(exc)
    return replies

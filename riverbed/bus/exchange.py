"""Two commands in one round trip, replies read one at a time: an append and the read after it.

An action's round trip is an append followed by a read: the agent appends the action and
blocks for the answer; the worker appends the answer and reads what came next.  Sent
separately, that is two trips to Redis per step.  :func:`exchange` writes both commands in one
send on a pooled connection and hands the replies back one by one, so the caller acts on the
append's outcome (announce the session, acknowledge, notice a fence) while the read is still
on its way (or, for the agent's blocking read, still waiting on the server).

Only a standalone client offers this; on a cluster :func:`exchange` yields ``None`` and the
caller sends the commands one by one.  A connection whose replies were not all read (an
error, a cancellation, a caller that stopped early) is closed rather than reused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import anyio
import hiredis
import redis.asyncio as aioredis
import redis.exceptions as rexc

from riverbed.bus.connection import RawClient, Shared, Turn, release_at_once, translate

__all__ = ["Exchange", "exchange", "stream_entries", "stream_entries_by_key", "written"]


class Exchange:
    """Commands sent in one write and their replies, read in order with :meth:`read`.

    ``async with exchange(client, *commands) as replies``: the commands go on a connection taken
    from the pool for the block (in turn with the client's other commands when it is
    :class:`Shared`); ``replies`` is ``None`` on a cluster.  Errors in the block (the replies'
    too) come out translated (:func:`~riverbed.bus.connection.translate`).  One object does what
    nested context managers did, at a fraction of the cost: it is on both sides of every action.
    """

    __slots__ = ("_client", "_commands", "_connection", "_turn", "unread", "url")

    def __init__(self, client: RawClient, commands: Sequence[Sequence[Any]], url: str) -> None:
        self._client = client
        self._commands = commands
        self._connection: Any = None
        self._turn: Turn | None = None
        self.unread = len(commands)
        self.url = url

    async def __aenter__(self) -> Exchange | None:
        client = self._client
        if not isinstance(client, aioredis.Redis) or client.single_connection_client:
            return None
        with translate(self.url):
            if isinstance(client, Shared):
                self._turn = Turn(client.limiter)
                await self._turn.__aenter__()
            try:
                pool = client.connection_pool
                self._connection = await pool.get_connection()  # type: ignore[no-untyped-call]
                packed = b"".join(hiredis.pack_command(tuple(c)) for c in self._commands)
                await self._connection.send_packed_command(packed)
            except BaseException:
                await self._finish()
                raise
        return self

    async def read(self) -> Any:
        """The next reply; an error reply raises (and counts as read)."""
        try:
            reply = await self._connection.read_response()
        except rexc.ResponseError:
            self.unread -= 1
            raise
        self.unread -= 1
        return reply

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        await self._finish()
        if exc is not None:
            with translate(self.url):
                raise exc

    async def _finish(self) -> None:
        """Give the connection back (closed when replies were left unread) and the turn."""
        connection, self._connection = self._connection, None
        try:
            if connection is not None:
                pool = self._client.connection_pool  # type: ignore[union-attr]
                if self.unread or not release_at_once(pool, connection):
                    with anyio.CancelScope(shield=True):
                        if self.unread:
                            await connection.disconnect(nowait=True)
                        await pool.release(connection)
        finally:
            if self._turn is not None:
                await self._turn.__aexit__(None, None, None)
                self._turn = None


def exchange(client: RawClient, *commands: Sequence[Any], url: str = "") -> Exchange:
    """:class:`Exchange` of ``commands`` on ``client`` (``url`` names it in translated errors)."""
    return Exchange(client, commands, url)


async def written(replies: Exchange, count: int) -> None:
    """Read the replies of ``count`` writes sent first (held writes: an error reply is the
    server refusing a write it would refuse again, and stops nothing)."""
    for _ in range(count):
        with contextlib.suppress(rexc.ResponseError):
            await replies.read()


def stream_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The (entry id, fields) pairs of a raw ``XREAD``/``XREADGROUP`` reply (RESP2 or RESP3)."""
    return [entry for _key, entries in stream_entries_by_key(reply) for entry in entries]


def stream_entries_by_key(reply: Any) -> list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """Each stream's key and (entry id, fields) pairs in a raw ``XREAD``/``XREADGROUP`` reply."""
    if not reply:
        return []
    streams = reply.items() if isinstance(reply, dict) else reply
    out: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] = []
    for key, entries in streams:
        pairs: list[tuple[bytes, dict[bytes, bytes]]] = []
        for raw_id, flat in entries:
            # (an entry deleted while pending has no fields)
            pairs.append((raw_id, {} if flat is None else dict(zip(flat[::2], flat[1::2], strict=True))))
        out.append((key, pairs))
    return out

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
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import hiredis
import redis.asyncio as aioredis
import redis.exceptions as rexc

from riverbed.bus.connection import RawClient, Shared

__all__ = ["Exchange", "exchange", "stream_entries"]


class Exchange:
    """The replies of commands sent together, in order."""

    def __init__(self, connection: Any, commands: int) -> None:
        self._connection = connection
        self.unread = commands

    async def read(self) -> Any:
        """The next reply; an error reply raises (and counts as read)."""
        try:
            reply = await self._connection.read_response()
        except rexc.ResponseError:
            self.unread -= 1
            raise
        self.unread -= 1
        return reply


@contextlib.asynccontextmanager
async def exchange(client: RawClient, *commands: Sequence[Any]) -> AsyncIterator[Exchange | None]:
    """Send ``commands`` in one write on a connection taken from the pool for the exchange
    (in turn with the client's other commands when it is :class:`Shared`); yields their
    :class:`Exchange` (``None`` on a cluster)."""
    if not isinstance(client, aioredis.Redis) or client.single_connection_client:
        yield None
        return
    turn: contextlib.AbstractAsyncContextManager[Any] = (
        client.limiter if isinstance(client, Shared) else contextlib.nullcontext()
    )
    async with turn, _pooled_exchange(client, commands) as replies:
        yield replies


@contextlib.asynccontextmanager
async def _pooled_exchange(client: aioredis.Redis, commands: Sequence[Sequence[Any]]) -> AsyncIterator[Exchange]:
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        async with _exchange(connection, commands) as replies:
            yield replies
    finally:
        with anyio.CancelScope(shield=True):
            await pool.release(connection)


@contextlib.asynccontextmanager
async def _exchange(connection: Any, commands: Sequence[Sequence[Any]]) -> AsyncIterator[Exchange]:
    replies = Exchange(connection, len(commands))
    try:
        await connection.send_packed_command(b"".join(hiredis.pack_command(tuple(c)) for c in commands))
        yield replies
    finally:
        if replies.unread:
            with anyio.CancelScope(shield=True):
                await connection.disconnect(nowait=True)


def stream_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The (entry id, fields) pairs of a raw ``XREAD``/``XREADGROUP`` reply (RESP2 or RESP3)."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else (entries for _key, entries in reply)
    out: list[tuple[bytes, dict[bytes, bytes]]] = []
    for entries in streams:
        for raw_id, flat in entries:
            if flat is None:  # an entry deleted while pending
                out.append((raw_id, {}))
            else:
                out.append((raw_id, dict(zip(flat[::2], flat[1::2], strict=True))))
    return out

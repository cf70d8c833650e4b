"""A session's log as Server-Sent Events, following live.

Each event is one SSE message whose ``id:`` is the event id and whose ``data:`` is the event's
JSON (the wire form of ``riverbed schema``, one line).  A client that reconnects sends the
last id it saw as ``Last-Event-ID`` and the stream resumes right after it: the log's ids are
dense and ordered, so nothing is missed or repeated.

The response is a plain ASGI callable rather than a generator, so that its three jobs run in
one task group with a clear end: following the log (:class:`~riverbed.serve.follow.Followers`:
one reader per session fans out to every stream, so a stream holds no Redis connection),
noticing the client leave (``http.disconnect``), the server stop or the key be revoked, and
sending a comment line when the session is quiet (so proxies keep the connection and a dead
client is noticed).  Whichever ends first cancels the others.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import structlog
from anyio.abc import ObjectSendStream
from starlette.types import Message, Receive, Scope, Send

from riverbed.errors import RiverbedError
from riverbed.serve.follow import Followers, Frame, frame

__all__ = ["EventStream", "frame"]

log = structlog.get_logger("riverbed.serve")

BUFFER = 256
"""Events read ahead of a slow client before following pauses."""


class EventStream:
    """``GET /v1/sessions/{id}/events`` with ``Accept: text/event-stream``."""

    def __init__(
        self,
        followers: Followers,
        session: str,
        start: int,
        until: int | None,
        *,
        heartbeat: float = 15.0,
        stopping: anyio.Event | None = None,
        revoked: anyio.Event | None = None,
        done: Callable[[], None] = lambda: None,
    ) -> None:
        self.followers = followers
        self.session = session
        self.start = start
        self.until = until
        self.heartbeat = heartbeat
        self.stopping = stopping or anyio.Event()
        self.revoked = revoked or anyio.Event()
        self.done = done
        """Called once the stream has ended (its slot is given back)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._stream(receive, send)
        finally:
            self.done()

    async def _stream(self, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-store"),
            (b"x-accel-buffering", b"no"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        gone = False
        try:
            await send({"type": "http.response.body", "body": b"retry: 1000\n\n", "more_body": True})
            tx, rx = anyio.create_memory_object_stream[Frame](BUFFER)
            with tx:  # (closed here too when the stream ends before the follower even began)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._follow, tx)
                    tg.start_soon(self._watch, receive, tg.cancel_scope)
                    async with rx:
                        while True:
                            with anyio.move_on_after(self.heartbeat) as quiet:
                                try:
                                    _id, message = await rx.receive()
                                except anyio.EndOfStream:
                                    break  # ``until`` reached
                            if quiet.cancelled_caught:
                                await send({"type": "http.response.body", "body": b": ping\n\n", "more_body": True})
                                continue
                            chunk = [message]
                            while True:  # whatever else is ready goes in the same write
                                try:
                                    chunk.append(rx.receive_nowait()[1])
                                except (anyio.WouldBlock, anyio.EndOfStream):
                                    break
                            await send({"type": "http.response.body", "body": b"".join(chunk), "more_body": True})
                    tg.cancel_scope.cancel()
        except* OSError:  # the client went away while we wrote
            gone = True
        except* RiverbedError as group:  # Redis failed under the stream: the client resumes later
            log.warning("serve.stream_failed", session=self.session, error=str(group.exceptions[0]))
        if not gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _follow(self, tx: ObjectSendStream[Frame]) -> None:
        await self.followers.follow(self.session, self.start, self.until, tx)

    async def _watch(self, receive: Receive, scope: anyio.CancelScope) -> None:
        """Cancel the stream when the client disconnects or the server stops."""
        async with anyio.create_task_group() as tg:

            async def disconnected() -> None:
                while True:
                    message: Message = await receive()
                    if message["type"] == "http.disconnect":
                        scope.cancel()
                        tg.cancel_scope.cancel()
                        return

            async def ended(event: anyio.Event) -> None:
                await event.wait()
                scope.cancel()
                tg.cancel_scope.cancel()

            tg.start_soon(disconnected)
            tg.start_soon(ended, self.stopping)
            tg.start_soon(ended, self.revoked)

"""An append and the read after it in one round trip: the agent's act and the worker's answer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis
import redis.exceptions as rexc

from riverbed import events
from riverbed.bus import scripts
from riverbed.bus.consumer import Answer, Entry, Owner, SessionContext
from riverbed.bus.exchange import exchange
from riverbed.client.session import Bus
from riverbed.errors import ActTimeout
from tests.kit.agents import runtime_worker

pytestmark = pytest.mark.anyio


def _answers(log: list[events.Event]) -> dict[int, list[int]]:
    """action id -> ids of the events answering it."""
    out: dict[int, list[int]] = {e.id or 0: [] for e in log if isinstance(e, events.Action)}
    for e in log:
        if not isinstance(e, events.Action) and e.cause in out:
            out[e.cause].append(e.id or 0)
    return out


async def test_act_is_answered_once_also_after_redis_forgot_the_scripts(bus: Bus, workspace: Path) -> None:
    session = bus.session("s1")
    async with runtime_worker(bus, workspace):
        written = await session.act(events.FileWrite(path="a.txt", content="one\n"), timeout=10)
        assert isinstance(written, events.FileWritten)
        for node_flush in [bus.redis.script_flush]:
            await node_flush()  # as after a Redis restart: EVALSHA now fails with NOSCRIPT
        read = await session.act(events.FileRead(path="a.txt"), timeout=10)
        assert isinstance(read, events.FileContent)
        assert read.content == "one\n"
        for _ in range(20):
            obs = await session.act(events.FileRead(path="a.txt"), timeout=10)
            assert isinstance(obs, events.FileContent)
    log = await session.events()
    assert len(log) == 2 * 22
    assert all(len(ids) == 1 for ids in _answers(log).values())


async def test_a_connection_lost_while_waiting_appends_once_and_still_gets_the_answer(standalone_bus: Bus) -> None:
    """The wait shares a connection with the append: killing it mid-wait makes the client
    repeat the append under the same idempotency key (no second action) and tail the log.

    Standalone only: a cluster client sends the append and the wait one by one (the other
    tests cover that path), so there is no shared connection to kill."""
    bus = standalone_bus
    assert isinstance(bus.redis, aioredis.Redis)
    session = bus.session("s1")
    await bus.redis.script_load(scripts.APPEND)  # else the first append goes alone, to load it
    result: list[events.Event] = []

    async def act() -> None:
        result.append(await session.act(events.FileRead(path="x"), timeout=10))

    async with anyio.create_task_group() as tg:
        tg.start_soon(act)
        with anyio.fail_after(5):
            while True:
                clients = await bus.redis.client_list()
                waiting = [c for c in clients if c.get("cmd") == "xread"]
                if waiting:
                    break
                await anyio.sleep(0.01)
        assert await session.last_id() == 1
        await bus.redis.client_kill_filter(_id=waiting[0]["id"])
        await anyio.sleep(0.2)
        await bus.log_store.append("s1", [events.FileContent(path="x", content="late", cause=1)])
    assert isinstance(result[0], events.FileContent)
    assert result[0].content == "late"
    log = await session.events()
    assert [e.kind for e in log] == ["file_read", "file_content"]


async def test_replies_left_unread_close_the_connection(bus: Bus, prefix: str) -> None:
    await bus.redis.set(f"{prefix}:text", "not a number")
    async with exchange(bus.redis, ("INCR", f"{prefix}:text"), ("PING",)) as replies:
        if replies is None:
            assert not isinstance(bus.redis, aioredis.Redis)
            return
        with pytest.raises(rexc.ResponseError):
            await replies.read()
        connection = replies._connection
    assert not connection.is_connected  # the PING reply was never read: not back in the pool as is
    assert await bus.redis.ping()
    async with exchange(bus.redis, ("SET", f"{prefix}:k", "v"), ("GET", f"{prefix}:k")) as replies:
        assert replies is not None
        assert await replies.read() == b"OK"
        assert await replies.read() == b"v"
        connection = replies._connection
    assert connection.is_connected  # every reply read: reused


class SoonHandler:
    """Answers every file_read, returning the batch's last answer (sent with the next read); a
    read of ``drain_on`` starts the owner's drain while it handles it."""

    role = "runtime"
    ignores_own_answers = True

    def __init__(self) -> None:
        self.drain_on = ""
        self.start_drain: Callable[[], None] = lambda: None

    async def open(self, ctx: SessionContext) -> None:
        return None

    async def close(self, ctx: SessionContext) -> None:
        return None

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> Answer | None:
        return await self.handle(ctx, entries)

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> Answer | None:
        for entry in entries:
            assert isinstance(entry.event, events.FileRead)
            if entry.event.path == self.drain_on:
                self.start_drain()
                await anyio.sleep(0.05)
            obs = events.FileContent(path=entry.event.path, content=str(entry.id))
            if entry is entries[-1]:
                return Answer(entry, obs)
            await ctx.answer(entry, obs)
        return None


async def test_held_answers_go_out_with_the_next_read_and_on_drain(bus: Bus) -> None:
    handler = SoonHandler()
    owner = Owner(bus.redis, bus.keys, handler, worker="w1", url=bus.url, lease_seconds=2)
    session = bus.session("s1")
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        handler.start_drain = lambda: tg.start_soon(owner.drain, 5.0)
        for i in range(5):
            obs = await session.act(events.FileRead(path=f"f{i}"), timeout=5)
            assert isinstance(obs, events.FileContent)
            assert obs.content == str(obs.cause)
        # A batch of three: two answered at once, the last held and sent with the next read.
        batch = await session.append(*[events.FileRead(path=f"g{i}") for i in range(3)])
        with anyio.fail_after(5):
            while len(await session.events()) < 10 + 6:
                await anyio.sleep(0.02)
        # The worker starts draining while it handles this one: the loop ends holding its
        # answer, which still goes out before the session is let go.
        handler.drain_on = "h"
        obs = await session.act(events.FileRead(path="h"), timeout=5)
        assert isinstance(obs, events.FileContent)
    log = await session.events()
    # The worker's answers moved its group past themselves, one after another: none was
    # delivered back to its handler (which would fail on it, and dead-letter it with an error).
    assert not [e for e in log if isinstance(e, events.Error)], log
    answers = _answers(log)
    assert len(answers) == 9
    assert all(len(a) == 1 for a in answers.values()), answers
    assert set(batch) <= set(answers)
    pending = await bus.redis.xpending(bus.keys.log("s1"), "runtime")
    assert pending["pending"] == 0


async def test_an_act_nobody_answers_times_out_naming_its_whole_timeout(bus: Bus) -> None:
    with pytest.raises(ActTimeout, match=r"within 1\.5s"):
        await bus.session("s1").act(events.FileRead(path="x"), timeout=1.5)
    assert [e.kind for e in await bus.session("s1").events()] == ["file_read"]

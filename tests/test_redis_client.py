"""The Redis adapter: riverbed's errors for every kind of call, and replies in one typed shape."""

from __future__ import annotations

import anyio
import pytest
import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from riverbed.bus.backoff import retry_unavailable
from riverbed.bus.redis_client import RedisClient
from riverbed.client.session import Bus
from riverbed.errors import ConfigError, UnavailableError

pytestmark = pytest.mark.anyio

UNREACHABLE = "redis://:hunter2@127.0.0.1:1/0"


@pytest.fixture
async def unreachable() -> RedisClient:
    raw = aioredis.Redis.from_url(UNREACHABLE, retry=Retry(NoBackoff(), 0), socket_connect_timeout=1)
    return RedisClient(raw, UNREACHABLE)


async def test_every_kind_of_call_to_an_unreachable_redis_is_unavailable_without_the_password(
    unreachable: RedisClient,
) -> None:
    async def pipelined() -> None:
        async with unreachable.pipeline() as pipe:
            pipe.get("k")
            await pipe.execute()

    async def scripted() -> None:
        await unreachable.script("return 1")([], [])

    async def exchanged() -> None:
        async with unreachable.exchange(("PING",)) as replies:
            assert replies is not None
            await replies.read()

    calls = [lambda: unreachable.hget("k", "f"), pipelined, scripted, exchanged]
    for call in calls:
        with pytest.raises(UnavailableError, match=r"cannot reach Redis at redis://:\*\*\*@127\.0\.0\.1:1/0") as failed:
            await call()
        assert "hunter2" not in str(failed.value)
    await unreachable.aclose()


async def test_stream_replies_are_entries_and_a_deleted_pending_entry_has_no_fields(bus: Bus, prefix: str) -> None:
    client = bus.client
    key = f"{prefix}:{{s}}:stream"
    assert await client.xgroup_create(key, "g", "0")
    assert not await client.xgroup_create(key, "g", "0")  # it exists: nothing changes
    first = await bus.redis.xadd(key, {"a": "1"})
    await bus.redis.xadd(key, {"b": "2"})
    delivered = await client.xreadgroup("g", "c", key, ">", count=10)
    assert delivered == [(first, {b"a": b"1"}), (delivered[1][0], {b"b": b"2"})]
    assert await client.xread(key, first.decode(), count=10) == delivered[1:]
    await client.xdel(key, first.decode())
    pending = await client.xreadgroup("g", "c", key, "0", count=10)
    assert pending == [(first, {}), delivered[1]]
    due = await client.xpending_range(key, "g", count=10, idle_ms=0)
    assert [entry["message_id"] for entry in due] == [first, delivered[1][0]]
    reclaimed = await client.xclaim(key, "g", "other", [entry["message_id"].decode() for entry in due])
    assert [fields for _id, fields in reclaimed] == [{b"b": b"2"}]  # the deleted one is dropped
    assert await client.xpending_range(key, "g", count=10, idle_ms=60_000) == []  # (none idle a minute)


async def test_pipelined_replies_are_filled_in_and_an_error_stays_with_its_command(bus: Bus, prefix: str) -> None:
    client = bus.client
    key = f"{prefix}:{{p}}:hash"
    await client.hset(key, "f", "v")
    async with client.pipeline() as pipe:
        value = pipe.hget(key, "f")
        wrong = pipe.xinfo_groups(key)  # a hash is no stream
        with pytest.raises(RuntimeError, match="before the pipeline ran"):
            _ = value.value
        await pipe.execute(raise_on_error=False)
    assert value.value == b"v"
    assert isinstance(wrong.error, rexc.ResponseError)
    with pytest.raises(rexc.ResponseError, match="WRONGTYPE"):
        _ = wrong.value


def _failing_sends(monkeypatch: pytest.MonkeyPatch, connection: type, errors: list[Exception]) -> None:
    """Make ``connection``'s sends raise the errors put in ``errors`` (one a send, last first),
    and send as before while it is empty."""
    send = connection.send_packed_command

    async def failing(self: object, *args: object, **kwargs: object) -> None:
        if errors:
            raise errors.pop()
        await send(self, *args, **kwargs)

    monkeypatch.setattr(connection, "send_packed_command", failing)


async def test_sent_writes_are_all_made_and_a_refused_one_raises_only_when_asked(bus: Bus, prefix: str) -> None:
    client = bus.client
    key, other = f"{prefix}:{{w}}:hash", f"{prefix}:{{w}}:set"
    await client.hset(key, "f", "v")
    writes = [("SET", other, "1"), ("XADD", key, "*", "a", "b"), ("SET", other, "2")]  # a hash is no stream
    with pytest.raises(rexc.ResponseError, match="WRONGTYPE"):
        await client.send(writes)
    assert await bus.redis.get(other) == b"2"  # the write after the refused one was made
    await client.send([("SET", other, "3"), ("XADD", key, "*", "a", "b")], raise_on_error=False)
    assert await bus.redis.get(other) == b"3"
    await client.send([])


async def test_writes_sent_on_a_connection_that_breaks_are_sent_again(
    standalone_bus: Bus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standalone client sends them in an exchange; a connection that breaks under it makes
    them go again in a pipeline, as the client library's own retry of a pipeline does."""
    from riverbed.bus._redispy import DirectSend  # noqa: PLC0415

    breaks: list[Exception] = [rexc.ConnectionError("connection reset by peer")]
    _failing_sends(monkeypatch, DirectSend, breaks)
    key = f"{prefix}:{{w}}:k"
    await standalone_bus.client.send([("SET", key, "1"), ("INCR", key)])
    assert not breaks
    assert await standalone_bus.redis.get(key) == b"2"


async def test_retry_unavailable_calls_until_redis_answers() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise UnavailableError("cannot reach Redis")
        return "answer"

    assert await retry_unavailable(flaky, first=0.001) == "answer"
    assert calls == 3


async def test_retry_unavailable_gives_up_once_stopping_and_leaves_other_errors_alone() -> None:
    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise UnavailableError("cannot reach Redis")

    stopping = anyio.Event()
    stopping.set()
    with pytest.raises(UnavailableError):
        await retry_unavailable(down, stopping=stopping, first=0.001)
    assert calls == 1

    async def broken() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("not Redis")

    with pytest.raises(ValueError, match="not Redis"):
        await retry_unavailable(broken, first=0.001)
    assert calls == 2


async def test_a_connection_closed_under_a_command_is_unavailable_and_the_next_call_goes_through(
    bus: Bus, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py leaks a transport's internals when a connection is closed while a command is on
    it (seen in a cluster failover: ``'NoneType' object has no attribute 'writelines'``, or
    uvloop's RuntimeError for the closed transport); that is a lost connection, retried like
    one, while any other AttributeError or RuntimeError stays a bug."""
    from redis.asyncio.connection import AbstractConnection  # noqa: PLC0415

    leaks: list[Exception] = []
    _failing_sends(monkeypatch, AbstractConnection, leaks)
    key = f"{prefix}:{{s}}:k"
    await bus.redis.hset(key, "f", "v")
    leaks.append(AttributeError("'NoneType' object has no attribute 'writelines'"))
    with pytest.raises(UnavailableError, match="closed under a command"):
        await bus.client.hget(key, "f")
    assert await retry_unavailable(lambda: bus.client.hget(key, "f")) == b"v"
    # uvloop's word for a write to the transport closed under the command
    leaks.append(
        RuntimeError("unable to perform operation on <TCPTransport closed=True reading=False>; the handler is closed")
    )
    with pytest.raises(UnavailableError, match="closed under a command"):
        await bus.client.hget(key, "f")
    assert await retry_unavailable(lambda: bus.client.hget(key, "f")) == b"v"
    leaks.append(AttributeError("'Entry' object has no attribute 'payload'"))
    with pytest.raises(AttributeError, match="payload"):
        await bus.client.hget(key, "f")
    leaks.append(RuntimeError("a bug of ours"))
    with pytest.raises(RuntimeError, match="a bug of ours"):
        await bus.client.hget(key, "f")


async def test_a_redis_older_than_riverbed_needs_is_refused_in_one_sentence(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The append script publishes with SPUBLISH (Redis 7.0): an older server is named at connect,
    not found out at the first append (the real server here is 7.x, so the bar is raised)."""
    import riverbed.bus.connection as connection  # noqa: PLC0415

    await (await connection.connect_redis(redis_url)).aclose()  # the server here is new enough
    monkeypatch.setattr(connection, "REDIS_MIN_VERSION", (99, 0))
    with pytest.raises(
        ConfigError,
        match=r"^the Redis at redis://127\.0\.0\.1:\d+/\d+ is 7\.[\d.]+; riverbed needs Redis 99\.0 or newer$",
    ):
        await connection.connect_redis(redis_url)


async def test_first_callers_of_a_script_wait_together_for_one_load(standalone_bus: Bus, prefix: str) -> None:
    script = standalone_bus.client.script(f"return '{prefix}'")  # a script this server has not seen
    probe = standalone_bus.redis
    before = (await probe.info("commandstats")).get("cmdstat_script|load", {}).get("calls", 0)
    done: list[int] = []
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while len(done) < 200:
            turns += 1
            await anyio.lowlevel.checkpoint()

    async def call() -> None:
        await script.load()
        done.append(turns)

    async with anyio.create_task_group() as tg:
        tg.start_soon(count_turns)
        for _ in range(200):
            tg.start_soon(call)
    after = (await probe.info("commandstats"))["cmdstat_script|load"]["calls"]
    assert after - before == 1
    # The waiters went on together once the load ended, not one per turn of the event loop.
    assert len(set(done)) <= 2
    assert await script([], []) == prefix.encode()

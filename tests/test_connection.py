"""The connections riverbed makes: commands written in the caller's task, under the socket
timeout; no PING on a socket just opened; the pool's quick hand-over, and its waiters."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio as aioredis

from riverbed import services
from riverbed.bus import _redispy
from riverbed.bus.connection import RECEIVE_BYTES, Turn, connect_redis
from riverbed.bus.exchange import exchange
from riverbed.bus.redis_client import RedisClient
from riverbed.client.session import Bus
from riverbed.errors import ConfigError, UnavailableError

pytestmark = pytest.mark.anyio


async def _note(into: list[str], what: str) -> None:
    into.append(what)


@pytest.fixture
async def private(tmp_path: Path) -> AsyncIterator[tuple[str, int]]:
    """A redis-server of the test's own (its counters and its process are the test's to use)."""
    url, pid = services.start_redis(tmp_path / "redis", appendonly=False)
    try:
        yield url, pid
    finally:
        os.kill(pid, signal.SIGCONT)
        services.stop_redis(pid)


@pytest.mark.parametrize("shared", [False, True], ids=["client", "worker"])
async def test_a_command_is_written_before_the_caller_gives_up_the_event_loop(
    standalone_bus: Bus, shared: bool
) -> None:
    raw = await connect_redis(standalone_bus.url, shared=shared)
    assert isinstance(raw, aioredis.Redis)
    try:
        connection = await raw.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        others: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_note, others, "ran")
            await connection.send_packed_command(connection.pack_command("PING"))
            # redis-py's send (asyncio.wait_for: a task per command) lets other tasks run first.
            assert others == []
            assert await connection.read_response() in (b"PONG", "PONG")
        assert others == ["ran"]
        await raw.connection_pool.release(connection)
    finally:
        await raw.aclose()


async def test_a_command_is_packed_by_hiredis_as_redis_py_would_pack_it(
    standalone_bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DirectSend.pack_command``: the bytes redis-py's packing makes, for every kind of value;
    redis-py's own way for a first argument of two words and for a value it refuses."""
    raw = await connect_redis(standalone_bus.url, shared=True)
    assert isinstance(raw, aioredis.Redis)
    plain = aioredis.Connection()
    packs = [
        ("SET", "k", "é"),
        (b"SET", b"k", b"\x00\xff"),
        ("ZADD", "z", 0.1 + 0.2, "m", 1e20, "n"),
        ("SET", "k", 2**70),
        ("EVALSHA", "a" * 40, 2, "k1", "k2", b"x" * 7000, memoryview(b"ab"), -5),
    ]
    try:
        connection = await raw.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        assert isinstance(connection, _redispy.DirectSend)
        expected = [b"".join(plain.pack_command(*args)) for args in packs]
        with monkeypatch.context() as patched:  # (the plain commands never reach redis-py's packing)
            patched.setattr(aioredis.Connection, "pack_command", None)
            assert [b"".join(connection.pack_command(*args)) for args in packs] == expected
        assert connection.pack_command("CONFIG GET", "port") == plain.pack_command("CONFIG GET", "port")
        with pytest.raises(redis.DataError):
            connection.pack_command("SET", "k", True)
        await raw.connection_pool.release(connection)
        assert await raw.set("k", "é")
        assert await raw.get("k") == "é".encode()
        port = standalone_bus.url.rsplit(":", 1)[1].split("/")[0]
        assert port in str(await raw.execute_command("CONFIG GET", "port"))
    finally:
        await raw.aclose()


@pytest.mark.parametrize(
    ("command", "error"),
    [
        # The server reads nothing: the socket's buffers fill up and the write waits.
        (("SET", "big", b"x" * (64 << 20)), "Timeout writing to socket"),
        # The command is written, and nothing answers it.
        (("PING",), "Timeout reading"),
    ],
    ids=["write", "read"],
)
async def test_a_server_that_stops_fails_a_command_within_the_socket_timeout(
    private: tuple[str, int], command: tuple[object, ...], error: str
) -> None:
    url, pid = private
    raw, connection = await _client_timing_out_after(url, 0.5)
    try:
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with anyio.fail_after(10), pytest.raises(UnavailableError, match=error):
            await _in_an_exchange(raw, url, command)
        assert time.monotonic() - started < 8  # the 0.5 s socket timeout, not the 10 s hang
        assert connection.socket_timeout == 0.5  # the command's own timeout is given back
        assert not connection.is_connected  # a half-written command or a reply still due: never reused
        os.kill(pid, signal.SIGCONT)
        assert await RedisClient(raw, url).ping()
    finally:
        os.kill(pid, signal.SIGCONT)
        await raw.aclose()


async def _client_timing_out_after(url: str, seconds: float) -> tuple[aioredis.Redis, Any]:
    """A client whose one connection (the one its next exchange takes) has ``seconds`` of socket timeout."""
    raw = await connect_redis(url)
    assert isinstance(raw, aioredis.Redis)
    connection = await raw.connection_pool.get_connection()  # type: ignore[no-untyped-call]
    connection.socket_timeout = seconds
    await raw.connection_pool.release(connection)
    return raw, connection


async def _in_an_exchange(raw: aioredis.Redis, url: str, command: tuple[object, ...]) -> None:
    async with exchange(raw, command, url=url) as replies:
        assert replies is not None
        await replies.read()


async def test_a_slow_reply_within_the_socket_timeout_is_read(private: tuple[str, int]) -> None:
    """The timer bounding a read is cancelled with it: a blocking read that takes most of the
    socket timeout gets its reply, and the connection stays open for the next command."""
    url, _pid = private
    raw, connection = await _client_timing_out_after(url, 1.0)
    try:
        for _ in range(3):  # each read's timer is its own: three reads of 0.6 s outlast one timeout
            async with exchange(raw, ("BLPOP", "nothing", 0.6), url=url) as replies:
                assert replies is not None
                assert await replies.read() is None
        assert connection.is_connected
        assert connection.socket_timeout == 1.0
    finally:
        await raw.aclose()


async def test_a_connection_receives_at_most_64_kib_at_a_time_and_still_reads_large_replies(
    private: tuple[str, int],
) -> None:
    """On asyncio's own event loop a receive asks for 64 KiB, not the transport's 256 KiB (each
    receive allocates what it asks for), and a reply of several megabytes still arrives whole."""
    url, _pid = private
    raw = await connect_redis(url)
    try:
        big = os.urandom(3 * 1024 * 1024 + 17)
        await raw.set("big", big)
        assert await raw.get("big") == big
        connection = await raw.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        assert connection._writer.transport.max_size == RECEIVE_BYTES == 64 * 1024
        await raw.connection_pool.release(connection)
    finally:
        await raw.aclose()


async def test_a_new_connection_is_not_pinged_before_its_first_command(private: tuple[str, int]) -> None:
    url, _pid = private
    probe = aioredis.Redis.from_url(url)
    await probe.config_resetstat()
    raw = await connect_redis(url, name="riverbed:test")
    try:
        await raw.set("k", "v")
        async with anyio.create_task_group() as tg:  # a burst: new connections for most of them
            for _ in range(20):
                tg.start_soon(raw.get, "k")
        stats = await probe.info("commandstats")
        assert stats["cmdstat_get"]["calls"] == 20
        assert "cmdstat_ping" not in stats
    finally:
        await raw.aclose()
        await probe.aclose()


async def test_a_command_waiting_for_the_only_connection_gets_it_when_an_exchange_gives_it_back(
    standalone_bus: Bus,
) -> None:
    raw = await connect_redis(standalone_bus.url, max_connections=1, shared=True)
    assert isinstance(raw, aioredis.Redis)  # (exchanges are standalone only)
    client = RedisClient(raw, standalone_bus.url)
    try:
        order: list[str] = []

        async def waiter() -> None:
            # A pipeline takes no turn (only commands and exchanges do): it waits in the pool.
            async with client.pipeline() as pipe:
                got = pipe.get("nothing here")
                await pipe.execute()
            order.append(f"get {got.value}")

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg, client.exchange(("ECHO", "a"), ("ECHO", "b")) as replies:
                assert replies is not None
                tg.start_soon(waiter)
                await anyio.sleep(0.05)
                assert order == []  # the pool's one connection is the exchange's
                order += [(await replies.read()).decode(), (await replies.read()).decode()]
        assert order == ["a", "b", "get None"]
        assert len(raw.connection_pool._in_use_connections) == 0  # type: ignore[attr-defined]
        assert len(raw.connection_pool._available_connections) == 1  # type: ignore[attr-defined]
    finally:
        await raw.aclose()


async def test_a_turn_is_taken_at_once_when_free_and_in_order_when_not() -> None:
    limiter = anyio.CapacityLimiter(1)
    order: list[int] = []
    others: list[str] = []

    async def take(i: int) -> None:
        async with Turn(limiter):
            order.append(i)
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(_note, others, "ran")
        async with Turn(limiter):
            assert others == []  # taken without giving up the event loop
            for i in range(5):
                tg.start_soon(take, i)
                await anyio.sleep(0.001)
    assert order == [0, 1, 2, 3, 4]
    assert limiter.borrowed_tokens == 0


async def test_a_new_connection_greets_the_server_in_one_write(private: tuple[str, int]) -> None:
    url, _pid = private
    probe = aioredis.Redis.from_url(url)
    await probe.acl_setuser(
        "agent", enabled=True, passwords=["+s3cret"], commands=["+@all"], keys=["*"], channels=["*"]
    )
    await probe.config_set("requirepass", "other")
    host = url.removeprefix("redis://")
    raw = await connect_redis(f"redis://agent:s3cret@{host}/3", name="riverbed:greeter")
    try:
        assert isinstance(raw, aioredis.Redis)
        pool = raw.connection_pool
        # A connection that knows nothing of the server yet (the pool's learn what it refuses).
        connection = pool.connection_class(**pool.connection_kwargs)
        writes: list[bytes] = []
        send = connection.send_packed_command

        async def counted(command: object, check_health: bool = True) -> None:
            writes.append(b"".join(command) if isinstance(command, list) else command)  # type: ignore[arg-type]
            await send(command, check_health)  # type: ignore[arg-type]

        connection.send_packed_command = counted
        await connection.connect()
        assert len(writes) == 1
        for command in (b"HELLO", b"AUTH", b"SETNAME", b"SETINFO", b"SELECT"):
            assert command in writes[0]
        await connection.disconnect()
        info = await raw.client_info()
        assert (info["name"], info["db"], info["user"], str(info["resp"])) == ("riverbed:greeter", 3, "agent", "3")
    finally:
        await raw.aclose()
    with pytest.raises(UnavailableError, match=r"password|auth"):
        await connect_redis(f"redis://agent:wrong@{host}/3")
    await probe.aclose()


async def test_a_greeting_command_the_server_refused_is_not_sent_again(private: tuple[str, int]) -> None:
    url, _pid = private
    probe = aioredis.Redis.from_url(url)
    # A user barred from CLIENT is refused CLIENT SETINFO, as a server older than Redis 7.2 refuses it.
    await probe.acl_setuser(
        "old", enabled=True, passwords=["+pw"], commands=["+@all", "-client"], keys=["*"], channels=["*"]
    )

    async def refusals() -> int:
        return int((await probe.info("stats"))["total_error_replies"])

    host = url.removeprefix("redis://")
    raw = await connect_redis(f"redis://old:pw@{host}")
    try:
        assert isinstance(raw, aioredis.Redis)
        learned = await refusals()
        assert learned >= 2  # the first connection's CLIENT SETINFO lines (and maintenance notifications)
        pool = raw.connection_pool
        connections = [await pool.get_connection() for _ in range(5)]  # type: ignore[no-untyped-call]
        assert all(c.is_connected for c in connections)
        assert await refusals() == learned
        for connection in connections:
            await pool.release(connection)
        assert await raw.ping()
    finally:
        await raw.aclose()
        await probe.aclose()


def test_the_redis_py_internals_riverbed_uses_are_all_there() -> None:
    missing = _redispy.missing_internals()
    assert not missing, (
        f"redis-py {redis.__version__} lacks {', '.join(missing)}: riverbed/bus/_redispy.py was written for "
        f"{_redispy.KNOWN}; adapt it to this version or pin redis-py"
    )


async def test_a_redis_py_without_an_internal_it_needs_is_refused_in_one_sentence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_redispy, "_AsyncRESP3Parser", object)  # as if an upgrade took its on_connect away
    _redispy.check_internals.cache_clear()
    with pytest.raises(ConfigError) as refused:
        await connect_redis("redis://127.0.0.1:1")  # refused before it connects
    message = str(refused.value)
    assert "_AsyncRESP3Parser.on_connect" in message
    assert _redispy.KNOWN in message
    assert "\n" not in message
    _redispy.check_internals.cache_clear()

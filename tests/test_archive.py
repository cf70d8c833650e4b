"""Retention against a real redis-server and a real Postgres: archive, trim, read across both."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import AsyncIterator

import anyio
import pytest

import riverbed
from riverbed import events
from riverbed.agent.replay import fork
from riverbed.bus.archive import Archive, Retention, first_stream_id, retain, safe_point
from riverbed.bus.consumer import Entry, Handler, SessionContext
from riverbed.bus.keys import ROLES
from riverbed.client.session import Bus
from riverbed.errors import ConfigError, InputError, RiverbedError
from riverbed.settings import Settings
from riverbed.workers.main import Worker
from tests.kit.cli import assert_one_sentence, ok, run, sample_events

pytestmark = pytest.mark.anyio


@pytest.fixture
async def bus(redis_url: str, database_url: str, prefix: str) -> AsyncIterator[Bus]:
    settings = Settings(redis_url=redis_url, database_url=database_url, prefix=prefix)
    async with riverbed.connect(redis_url, settings=settings) as bus:
        yield bus


@pytest.fixture
async def bare(redis_url: str, prefix: str) -> AsyncIterator[Bus]:
    """The same Redis without a database: archived events cannot be read through it."""
    async with riverbed.connect(redis_url, settings=Settings(redis_url=redis_url, prefix=prefix)) as bus:
        yield bus


def archive_of(bus: Bus) -> Archive:
    assert bus.archive is not None
    return bus.archive


async def deliver(bus: Bus, session: str, role: str, upto: int, *, unacked: tuple[int, ...] = ()) -> None:
    """Deliver events 1..upto to ``role``'s group and acknowledge all but ``unacked``."""
    key = bus.keys.log(session)
    groups = {g["name"].decode() for g in await bus.redis.xinfo_groups(key)}
    if role not in groups:
        await bus.redis.xgroup_create(key, role, id="0")
    done = 0
    while done < upto:
        reply = await bus.redis.xreadgroup(role, "tester", {key: ">"}, count=upto - done)
        ids = [raw_id for _s, entries in reply for raw_id, _f in entries]
        if not ids:
            break
        done = int(ids[-1].partition(b"-")[0])
        acks = [i for i in ids if int(i.partition(b"-")[0]) not in unacked]
        if acks:
            await bus.redis.xack(key, role, *acks)


async def finish_all(bus: Bus, session: str) -> None:
    last = await bus.log_store.last_id(session)
    for role in ROLES:
        await deliver(bus, session, role, last)


async def raw(bus: Bus, session: str, start: int = 1, end: int | None = None) -> list[tuple[int, bytes]]:
    return [pair async for pair in bus.log_store.read_raw(session, start, end)]


async def test_archived_session_reads_byte_identical(bus: Bus) -> None:
    session = bus.session("big")
    batch = sample_events(5000)
    for begin in range(0, len(batch), 500):
        await session.append(*batch[begin : begin + 500])
    before_raw = await raw(bus, "big")
    before_json = [events.encode_json(e) for e in await session.events()]
    assert len(before_raw) == 5000
    await finish_all(bus, "big")

    trimmed = await retain(bus.redis, bus.keys, archive_of(bus), "big", older_than_seconds=0, keep_last=100)

    assert trimmed == 4900
    assert await bus.redis.xlen(bus.keys.log("big")) == 100
    assert await first_stream_id(bus.redis, bus.keys, "big") == 4901
    assert (await bus.log_store.meta("big"))["archived_to"] == "4900"
    assert await archive_of(bus).count("big") == 4900
    assert await raw(bus, "big") == before_raw
    assert [events.encode_json(e) for e in await session.events()] == before_json
    for start, end in [(1, 1), (10, 20), (1999, 2002), (4890, 4910), (4900, 4900), (4901, None), (4999, 6000)]:
        want = before_json[start - 1 : end]
        assert [events.encode_json(e) for e in await session.events(start, end)] == want, (start, end)
    assert await raw(bus, "big", 4899, 4902) == before_raw[4898:4902]

    stop = anyio.Event()
    followed: list[int] = []
    with anyio.fail_after(10):
        async for event in bus.log_store.follow("big", 4890, block_ms=100, stop=stop):
            followed.append(event.id or 0)
            if event.id == 5000:
                stop.set()
    assert followed == list(range(4890, 5001))


async def test_cli_log_and_export_read_through_the_archive(
    bus: Bus, cli_env: dict[str, str], database_url: str
) -> None:
    session = bus.session("cli")
    await session.append(*sample_events(300))
    env = {**cli_env, "RIVERBED_DATABASE_URL": database_url}
    log_before = ok(env, "log", "cli", "--json")
    export_before = ok(env, "export", "cli")
    await finish_all(bus, "cli")

    result = run(env, "archive", "cli", "--older-than", "0", "--keep-last", "10")

    assert result.returncode == 0, result.stderr.decode()
    said = result.stderr.decode()
    assert "Moved 290 events of session cli from Redis to the Postgres archive" in said
    assert "which now holds its events 1 to 290; the rest stay in Redis." in said
    assert await bus.redis.xlen(bus.keys.log("cli")) == 10
    assert ok(env, "log", "cli", "--json") == log_before
    assert ok(env, "export", "cli") == export_before
    assert ok(env, "log", "cli", "--json", "--from", "280", "--until", "295") == b"\n".join(
        [*log_before.splitlines()[279:295], b""]
    )
    lines = [json.loads(line) for line in log_before.splitlines()]
    assert [line["id"] for line in lines] == list(range(1, 301))

    assert_one_sentence(run(cli_env, "archive", "cli"), 2, "RIVERBED_DATABASE_URL")
    assert_one_sentence(run(cli_env, "log", "cli", "--json"), 2, "archive", "RIVERBED_DATABASE_URL")


async def test_trim_never_passes_an_event_pending_or_undelivered_in_any_group(bus: Bus) -> None:
    session = bus.session("busy")
    await session.append(*[events.Think(thought=str(i)) for i in range(300)])
    archive = archive_of(bus)
    await deliver(bus, "busy", "runtime", 300)
    await deliver(bus, "busy", "memory", 200, unacked=(120, 180))
    assert await safe_point(bus.redis, bus.keys, "busy", keep_last=1) == 0  # no condenser group yet
    assert await retain(bus.redis, bus.keys, archive, "busy", older_than_seconds=0, keep_last=1) == 0
    assert await bus.redis.xlen(bus.keys.log("busy")) == 300
    assert await archive.count("busy") == 0

    await deliver(bus, "busy", "condenser", 150)
    assert await retain(bus.redis, bus.keys, archive, "busy", older_than_seconds=0, keep_last=1) == 119
    assert await first_stream_id(bus.redis, bus.keys, "busy") == 120
    pending = await bus.redis.xpending_range(bus.keys.log("busy"), "memory", min="-", max="+", count=10)
    assert [p["message_id"] for p in pending] == [b"120-0", b"180-0"]
    claimed = await bus.redis.xclaim(bus.keys.log("busy"), "memory", "new-owner", 0, [b"120-0", b"180-0"])
    assert [entry_id for entry_id, fields in claimed if fields] == [b"120-0", b"180-0"]

    await bus.redis.xack(bus.keys.log("busy"), "memory", "120-0")
    assert await retain(bus.redis, bus.keys, archive, "busy", older_than_seconds=0, keep_last=1) == 31
    assert await first_stream_id(bus.redis, bus.keys, "busy") == 151  # after the condenser's last delivered

    await bus.redis.xack(bus.keys.log("busy"), "memory", "180-0")
    await deliver(bus, "busy", "condenser", 300)
    await deliver(bus, "busy", "memory", 300)
    assert await retain(bus.redis, bus.keys, archive, "busy", older_than_seconds=0, keep_last=40) == 110
    assert await first_stream_id(bus.redis, bus.keys, "busy") == 261
    assert [e.id for e in await session.events()] == list(range(1, 301))


async def test_only_events_older_than_the_threshold_are_archived(bus: Bus) -> None:
    session = bus.session("aged")
    old = dt.datetime.now(dt.UTC) - dt.timedelta(hours=2)
    await session.append(*[events.Think(thought=f"old {i}", ts=old) for i in range(30)])
    await session.append(*[events.Think(thought=f"new {i}") for i in range(20)])
    await session.append(events.Think(thought="old again", ts=old))
    await finish_all(bus, "aged")

    assert await retain(bus.redis, bus.keys, archive_of(bus), "aged", older_than_seconds=3600, keep_last=1) == 30
    assert await first_stream_id(bus.redis, bus.keys, "aged") == 31
    with pytest.raises(InputError, match="keep_last"):
        await retain(bus.redis, bus.keys, archive_of(bus), "aged", older_than_seconds=0, keep_last=0)


async def test_a_pass_killed_between_copy_and_trim_is_repaired_without_duplicates(bus: Bus) -> None:
    session = bus.session("crash")
    await session.append(*sample_events(400))
    before = await raw(bus, "crash")
    await finish_all(bus, "crash")
    archive = archive_of(bus)

    assert await archive.copy("crash", before[:250]) == 250  # the pass died here, before the trim
    assert await bus.redis.xlen(bus.keys.log("crash")) == 400
    assert await raw(bus, "crash") == before

    assert await retain(bus.redis, bus.keys, archive, "crash", older_than_seconds=0, keep_last=50) == 350
    assert await archive.count("crash") == 350
    assert await archive.copy("crash", before[:350]) == 0
    assert await archive.count("crash") == 350
    assert await raw(bus, "crash") == before
    assert await retain(bus.redis, bus.keys, archive, "crash", older_than_seconds=0, keep_last=50) == 0


async def test_other_bytes_in_the_archive_stop_the_trim(bus: Bus) -> None:
    session = bus.session("clash")
    await session.append(*[events.Think(thought=str(i)) for i in range(10)])
    await finish_all(bus, "clash")
    await archive_of(bus).copy("clash", [(3, events.encode(events.Think(thought="something else")))])

    with pytest.raises(RiverbedError, match="other bytes"):
        await retain(bus.redis, bus.keys, archive_of(bus), "clash", older_than_seconds=0, keep_last=1)
    assert await bus.redis.xlen(bus.keys.log("clash")) == 10
    assert await archive_of(bus).count("clash") == 1


async def test_view_until_an_event_is_the_same_across_the_boundary(bus: Bus) -> None:
    session = bus.session("viewed")
    for i in range(40):
        (action,) = await session.append(events.CmdRun(command=f"echo {i}"))
        await bus.log_store.append("viewed", [events.CmdOutput(content=str(i), exit_code=0, cause=action)])
    await session.append(
        events.Condensation(forgotten=[(3, 30)], summary="the first echoes", summary_offset=2, source="condenser")
    )
    await session.append(events.Message(content="done?", source="user"))
    points = [None, 1, 10, 49, 50, 51, 60, 81, 82]
    before = {n: [_plain(item) for item in await session.view(until=n)] for n in points}
    await finish_all(bus, "viewed")

    assert await retain(bus.redis, bus.keys, archive_of(bus), "viewed", older_than_seconds=0, keep_last=32) == 50

    for n in points:
        assert [_plain(item) for item in await session.view(until=n)] == before[n], n


def _plain(item: object) -> object:
    return events.to_builtins(item) if isinstance(item, events.Event) else repr(item)


async def test_fork_of_an_archived_session(bus: Bus) -> None:
    source = bus.session("old")
    await source.append(*sample_events(120))
    before = await raw(bus, "old")
    await finish_all(bus, "old")
    assert await retain(bus.redis, bus.keys, archive_of(bus), "old", older_than_seconds=0, keep_last=20) == 100

    assert await fork(bus, "old", 110, "young") == 111
    assert await raw(bus, "young", 1, 110) == before[:110]
    assert await fork(bus, "old", 40, "younger") == 41
    assert await raw(bus, "younger", 1, 40) == before[:40]
    forked = (await bus.session("younger").events(41, 41))[0]
    assert isinstance(forked, events.Forked)
    assert (forked.source_session, forked.at) == ("old", 40)


async def test_archived_events_without_a_database_are_one_clear_error(bus: Bus, bare: Bus) -> None:
    session = bus.session("far")
    await session.append(*[events.Think(thought=str(i)) for i in range(50)])
    await finish_all(bus, "far")
    assert await retain(bus.redis, bus.keys, archive_of(bus), "far", older_than_seconds=0, keep_last=5) == 45

    assert [e.id for e in await bare.session("far").events(46)] == [46, 47, 48, 49, 50]
    with pytest.raises(ConfigError) as info:
        await bare.session("far").events()
    message = str(info.value)
    assert message == (
        "events 1..45 of session 'far' were moved to the Postgres archive: set RIVERBED_DATABASE_URL to read them"
    )
    with pytest.raises(ConfigError, match=r"events 10\.\.20 of session 'far'"):
        await bare.session("far").events(10, 20)
    with pytest.raises(ConfigError, match="moved to the Postgres archive"):
        await fork(bare, "far", 10, "nowhere")


async def test_a_read_that_needs_no_archive_never_connects_to_postgres(redis_url: str, prefix: str) -> None:
    settings = Settings(redis_url=redis_url, database_url="postgresql://nobody@127.0.0.1:1/none", prefix=prefix)
    async with riverbed.connect(redis_url, settings=settings) as bus:
        session = bus.session("fresh")
        await session.append(*[events.Think(thought=str(i)) for i in range(10)])
        assert [e.id for e in await session.events()] == list(range(1, 11))
        assert await session.events(11) == []
        assert await bus.session("missing").events() == []
        assert bus.archive is not None
        assert not bus.archive.started


async def test_a_retention_pass_skips_sessions_a_role_has_not_seen(bus: Bus) -> None:
    for name in ("r1", "r2"):
        await bus.session(name).append(*[events.Think(thought=str(i)) for i in range(30)])
        await finish_all(bus, name)
    await bus.session("r3").append(*[events.Think(thought=str(i)) for i in range(30)])
    retention = Retention(bus.redis, bus.keys, archive_of(bus), older_than_seconds=0, keep_last=10)

    assert await retention.once(["r1", "r2", "r3", "never-written"]) == 40
    assert [await first_stream_id(bus.redis, bus.keys, s) for s in ("r1", "r2", "r3")] == [21, 21, 1]
    assert await retention.once(["r1", "r2", "r3"]) == 0


class Acker:
    """A role that acknowledges every entry (progress without any work)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.ignores_own_answers = False

    async def open(self, ctx: SessionContext) -> None:
        pass

    async def recover(self, ctx: SessionContext, entries: list[Entry]) -> None:
        await ctx.ack([e.id for e in entries])

    async def handle(self, ctx: SessionContext, entries: list[Entry]) -> None:
        await ctx.ack([e.id for e in entries])

    async def close(self, ctx: SessionContext) -> None:
        pass


async def test_a_memory_worker_archives_the_sessions_it_owns(bus: Bus, redis_url: str, database_url: str) -> None:
    settings = Settings(
        redis_url=redis_url,
        database_url=database_url,
        prefix=bus.keys.prefix,
        retention_seconds=0.001,
        retention_keep_last=5,
    )
    archive = Archive(database_url, schema=bus.keys.prefix)
    handlers: dict[str, Handler] = {role: Acker(role) for role in ROLES}
    worker = Worker(bus.redis, settings, list(ROLES), name="w1", handlers=handlers, url=redis_url, archive=archive)
    assert worker.retention is not None
    worker.retention.period = 0.05
    session = bus.session("served")
    await session.append(*[events.Think(thought=str(i)) for i in range(40)])
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            with anyio.fail_after(20):
                while await first_stream_id(bus.redis, bus.keys, "served") != 36:
                    await anyio.sleep(0.05)
            assert all(owner.log.archive is archive for owner in worker.owners.values())
            worker.stop()
    finally:
        await archive.close()
    assert [e.id for e in await session.events()] == list(range(1, 41))

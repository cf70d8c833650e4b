"""An owner in-process while its Redis state vanishes under it: each way it notices and rebuilds.

The keys of one test prefix stand in for a whole wiped Redis (``tests/test_fault_wipe.py``
wipes a real server under worker processes): a session's keys deleted under its owner, a log
that starts over at id 1 while its owner's read is blocked on it, and a directory that a role
loop cannot read at all (a key of the wrong type), which must turn ``/readyz`` red and say why.
"""

from __future__ import annotations

import json
from functools import partial

import anyio
import pytest

from riverbed import events
from riverbed.client.session import Bus
from riverbed.settings import Settings
from riverbed.workers.http import Health, serve
from riverbed.workers.main import Worker
from tests.kit.metrics import get
from tests.kit.owners import EchoHandler, make_owner

pytestmark = pytest.mark.anyio

#: Long, so that a renewal does not notice first: these tests are about the session loop.
LEASE = 30.0

# Deletes a session's keys and appends one event as a new log would have it (id 1, the role's
# group created at 0), in one step: the owner's blocked read wakes up to a log that started over.
START_OVER = """
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('XGROUP', 'CREATE', KEYS[1], 'runtime', '0', 'MKSTREAM')
redis.call('XADD', KEYS[1], '1-0', 'e', ARGV[1])
redis.call('HSET', KEYS[2], 'last', 1, 'created', 0)
return 1
"""


async def wait_owned(owner: object, session: str, token: int) -> None:
    owned = getattr(owner, "owned", {})
    with anyio.fail_after(10):
        while session not in owned or owned[session].token != token:
            await anyio.sleep(0.02)


@pytest.mark.parametrize("append_at_once", [False, True], ids=["owner-notices-first", "announced-while-held"])
async def test_a_session_whose_keys_vanish_is_let_go_and_served_again_from_id_1(bus: Bus, append_at_once: bool) -> None:
    """The owner notices on its own (its log group is gone, its lease with it) and lets the
    session go without creating its log again; or the session is announced anew while the
    owner still holds it, and the owner ends the stale loop and takes it as new."""
    owner, handler = make_owner(bus, "w1", lease_seconds=LEASE)
    session = bus.session("gone")
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        for _ in range(3):
            assert isinstance(await session.act(events.FileRead(path="p"), timeout=5), events.FileContent)
        await wait_owned(owner, "gone", 1)
        await bus.redis.delete(bus.keys.log("gone"), bus.keys.meta("gone"), bus.keys.answers("gone"))
        if not append_at_once:
            with anyio.fail_after(5):
                while "gone" in owner.owned:
                    await anyio.sleep(0.02)
            assert not await bus.redis.exists(bus.keys.log("gone")), "the stale owner created the log again"

        answer = await session.act(events.FileRead(path="again"), timeout=5)
        assert isinstance(answer, events.FileContent)
        assert answer.id == 2  # the log started over: the action is 1, its answer 2
        assert answer.cause == 1
        assert [e.id for e in await session.events()] == [1, 2]
        assert handler.seen.count(("gone", 1)) == 2  # once in each life of the log
        await owner.drain(2)


async def test_a_log_that_starts_over_under_its_owner_is_not_served_by_the_stale_loop(bus: Bus) -> None:
    owner, handler = make_owner(bus, "w1", lease_seconds=LEASE)
    session = bus.session("again")
    async with anyio.create_task_group() as tg:
        await tg.start(owner.run)
        for _ in range(3):
            assert isinstance(await session.act(events.FileRead(path="p"), timeout=5), events.FileContent)
        await wait_owned(owner, "again", 1)
        stale = owner.owned["again"]

        payload = events.encode(events.FileRead(path="new", source="agent"))
        keys = [bus.keys.log("again"), bus.keys.meta("again"), bus.keys.answers("again")]
        await bus.redis.eval(START_OVER, len(keys), *keys, payload)
        with anyio.fail_after(10):
            while owner.owned.get("again") is stale:
                await anyio.sleep(0.02)
        # Announced as a new session's first append announces it: the owner takes it anew.
        await bus.log_store.announce("again", ["runtime"], created=True)
        answer = await session.wait_for_answer(1, timeout=5)
        assert isinstance(answer, events.FileContent)
        assert answer.path == "new"
        assert handler.seen.count(("again", 1)) == 2, handler.seen  # the first life's, and this one once
        assert [e.id for e in await session.events()] == [1, 2]
        await owner.drain(2)


async def test_a_role_loop_that_keeps_failing_turns_readyz_red_until_it_recovers(bus: Bus, prefix: str) -> None:
    settings = Settings(prefix=prefix, lease_seconds=2.0, drain_seconds=2.0)
    worker = Worker(bus.redis, settings, ["runtime"], name="w-red", handlers={"runtime": EchoHandler()}, url=bus.url)
    directory = bus.keys.directory("runtime")
    async with anyio.create_task_group() as tg:
        port = await tg.start(partial(serve, worker, 0, host="127.0.0.1", refresh_seconds=0.1, health=Health()))
        async with anyio.create_task_group() as running:
            await running.start(worker.run)
            with anyio.fail_after(10):
                while (await get(port, "/readyz"))[0] != 200:
                    await anyio.sleep(0.05)

            # The directory is lost and its key holds something else: every intake round fails.
            await bus.redis.delete(directory)
            await bus.redis.set(directory, "not a stream")
            with anyio.fail_after(10):
                while (reply := await get(port, "/readyz"))[0] != 503:
                    await anyio.sleep(0.05)
            reasons = json.loads(reply[2])["reasons"]
            assert any(r.startswith("runtime intake failing since ") and "WRONGTYPE" in r for r in reasons), reasons
            assert "intake" in worker.describe()["failing"]["runtime"]

            await bus.redis.delete(directory)
            with anyio.fail_after(10):
                while (await get(port, "/readyz"))[0] != 200:
                    await anyio.sleep(0.05)
            assert worker.describe()["failing"] == {}
            answer = await bus.session("after").act(events.FileRead(path="p"), timeout=5)
            assert isinstance(answer, events.FileContent)
            worker.stop()
        tg.cancel_scope.cancel()

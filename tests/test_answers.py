"""A client's waits for answers, many on a few connections (``riverbed/client/answers.py``),
with a real runtime worker process and Redis:

- a burst of acts from one client beyond its connections is answered over a handful more, each once;
- the same burst while every client connection of the server is killed, twice: every act is
  answered, and no action is appended twice;
- an act waiting longer than its first blocking read holds no connection;
- crowded acts of one session at once share one bell (one subscription);
- a crowded act whose log Redis lost fails with ``NotFoundError``, one with no worker with
  ``ActTimeout``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from riverbed import events
from riverbed.client.answers import Answers
from riverbed.client.session import Bus
from riverbed.errors import ActTimeout, NotFoundError
from riverbed.runtime.paths import workspace_name
from tests.kit.answers import check_exactly_one_answer
from tests.kit.workers import WorkerProcess, standalone_worker  # noqa: F401  (standalone_worker: a fixture)

pytestmark = pytest.mark.anyio

BURST = 300


@pytest.fixture
def worker(standalone_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return standalone_worker(
        "answers-w1", extra_env={"RIVERBED_CONCURRENCY": str(BURST + 10), "RIVERBED_SANDBOX": "process"}
    )


def _sessions(workspace: Path, count: int) -> list[str]:
    """Sessions whose workspaces hold ``note.txt`` naming the session."""
    ids = [f"burst-{i}" for i in range(count)]
    for sid in ids:
        (workspace / workspace_name(sid)).mkdir(parents=True)
        (workspace / workspace_name(sid) / "note.txt").write_text(f"note of {sid}\n")
    return ids


def _connections(bus: Bus) -> int:
    pool: Any = bus.redis.connection_pool
    return len(pool._available_connections) + len(pool._in_use_connections)


async def _burst(bus: Bus, ids: list[str]) -> dict[str, events.Event]:
    answers: dict[str, events.Event] = {}

    async def act(sid: str) -> None:
        answers[sid] = await bus.session(sid).act(events.FileRead(path="note.txt"), timeout=60)

    async with anyio.create_task_group() as tg:
        for sid in ids:
            tg.start_soon(act, sid)
    return answers


async def _check(bus: Bus, ids: list[str], answers: dict[str, events.Event]) -> None:
    for sid in ids:
        answer = answers[sid]
        assert isinstance(answer, events.FileContent), answer
        assert answer.content == f"note of {sid}\n"
        log = await check_exactly_one_answer(bus, sid)
        assert [type(e) for e in log] == [events.FileRead, events.FileContent], sid


async def test_a_burst_of_acts_is_answered_over_a_handful_of_connections(
    standalone_bus: Bus, worker: WorkerProcess, workspace: Path
) -> None:
    assert standalone_bus.answers is not None
    standalone_bus.answers.most = 8
    ids = _sessions(workspace, BURST)
    answers = await _burst(standalone_bus, ids)
    await _check(standalone_bus, ids, answers)
    # Eight acts on connections of their own, the rest crowded; batches take a few more.
    assert _connections(standalone_bus) <= 8 + 4
    assert standalone_bus.answers.wakeups.connections == 1


async def test_a_burst_is_answered_once_each_while_every_connection_is_killed(
    standalone_bus: Bus, worker: WorkerProcess, workspace: Path, standalone_redis_url: str
) -> None:
    assert standalone_bus.answers is not None
    standalone_bus.answers.most = 8
    ids = _sessions(workspace, BURST)
    probe = aioredis.Redis.from_url(standalone_redis_url)
    killed = 0

    async def kill_all() -> None:
        nonlocal killed
        for _ in range(2):
            await anyio.sleep(0.15)
            killed += await probe.client_kill_filter(_type="normal", skipme=True)
            killed += await probe.client_kill_filter(_type="pubsub", skipme=True)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_all)
            answers = await _burst(standalone_bus, ids)
    finally:
        await probe.aclose()
    assert killed > 0
    await _check(standalone_bus, ids, answers)


async def test_a_long_wait_holds_no_connection(standalone_bus: Bus, worker: WorkerProcess) -> None:
    session = standalone_bus.session("slow")
    await session.act(events.CmdRun(command="true"), timeout=30)  # the worker takes the session
    result: list[events.Event] = []

    async def act() -> None:
        result.append(await session.act(events.CmdRun(command="sleep 2.5; echo done"), timeout=30))

    async with anyio.create_task_group() as tg:
        tg.start_soon(act)
        await anyio.sleep(1.8)  # past the first blocking read (1 s)
        pool: Any = standalone_bus.redis.connection_pool
        assert len(pool._in_use_connections) == 0
    (answer,) = result
    assert isinstance(answer, events.CmdOutput)
    assert answer.content.strip() == "done"


@contextlib.asynccontextmanager
async def _crowded(bus: Bus) -> AsyncIterator[Answers]:
    """``bus``'s answers with every free connection held and none to be opened: each act is crowded."""
    answers = bus.answers
    assert answers is not None
    answers.most = 0
    pool: Any = bus.redis.connection_pool
    held = [await pool.get_connection() for _ in range(len(pool._available_connections))]
    try:
        assert answers.crowded()
        yield answers
    finally:
        for connection in held:
            await pool.release(connection)


async def test_a_crowded_act_fails_clearly_without_a_worker_or_its_log(standalone_bus: Bus) -> None:
    async with _crowded(standalone_bus):
        before = _connections(standalone_bus)
        with pytest.raises(ActTimeout, match="no observation answered action 1 in session 'nobody'"):
            await standalone_bus.session("nobody").act(events.CmdRun(command="true"), timeout=1.5)

        session = standalone_bus.session("lost")
        outcome: list[BaseException] = []

        async def act() -> None:
            try:
                await session.act(events.CmdRun(command="true"), timeout=30)
            except NotFoundError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(act)
            while not await standalone_bus.redis.exists(standalone_bus.keys.log("lost")):
                await anyio.sleep(0.05)
            started = anyio.current_time()
            keys = standalone_bus.keys
            await standalone_bus.redis.delete(keys.log("lost"), keys.meta("lost"))  # Redis lost them
        assert anyio.current_time() - started < 5
        (error,) = outcome
        assert "no longer in its log" in str(error)
        # The crowded acts opened no connection of their own (their batches took one at most).
        assert _connections(standalone_bus) <= before + 1


async def test_crowded_acts_of_one_session_share_its_bell(standalone_bus: Bus, worker: WorkerProcess) -> None:
    async with _crowded(standalone_bus) as answers:
        session = standalone_bus.session("twice")
        outputs: list[str] = []

        async def act(word: str) -> None:
            obs = await session.act(events.CmdRun(command=f"echo {word}"), timeout=30)
            assert isinstance(obs, events.CmdOutput)
            outputs.append(obs.content.strip())

        async with anyio.create_task_group() as tg:
            for word in ("one", "two", "three"):
                tg.start_soon(act, word)
        assert sorted(outputs) == ["one", "three", "two"]
        channel = standalone_bus.keys.wake("twice")
        assert len(answers.wakeups._watched[channel].bells) == 1

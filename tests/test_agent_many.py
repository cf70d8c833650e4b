"""Many agents on one bus, served by a real worker process: each gets its own answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.client.session import Bus
from tests.kit.workers import WorkerProcess

pytestmark = pytest.mark.anyio

ACTIONS = 20


@pytest.fixture
def worker(redis_url: str, prefix: str, workspace: Path) -> Iterator[WorkerProcess]:
    process = WorkerProcess(["runtime"], name="many", redis_url=redis_url, prefix=prefix, workspace=workspace)
    try:
        process.wait_ready()
        yield process
    finally:
        process.close()


async def drive(bus: Bus, session_id: str, agent: str, results: dict[str, list[tuple[int, events.Event]]]) -> None:
    session = bus.session(session_id, agent=agent)
    got = results.setdefault(agent, [])
    for i in range(ACTIONS):
        if i % 2:
            action: events.Action = events.CmdRun(command=f"echo {agent}-{i}")
        else:
            action = events.PythonRun(code=f"'{agent}-{i}'")
        (action_id,) = await session.append(action)
        got.append((action_id, await session.wait_for_answer(action_id, timeout=30)))


def check_own_answers(agent: str, answers: list[tuple[int, events.Event]]) -> None:
    assert len(answers) == ACTIONS
    for i, (action_id, obs) in enumerate(answers):
        assert obs.cause == action_id
        if i % 2:
            assert isinstance(obs, events.CmdOutput), obs
            assert obs.content.strip() == f"{agent}-{i}"
        else:
            assert isinstance(obs, events.PythonOutput), obs
            assert obs.result == repr(f"{agent}-{i}")


async def test_two_agents_share_one_session_and_each_gets_its_own_observations(bus: Bus, worker: WorkerProcess) -> None:
    results: dict[str, list[tuple[int, events.Event]]] = {}
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            tg.start_soon(drive, bus, "shared", "alice", results)
            tg.start_soon(drive, bus, "shared", "bob", results)
    for agent in ("alice", "bob"):
        check_own_answers(agent, results[agent])

    log = await bus.session("shared").events()
    assert len(log) == 4 * ACTIONS
    actions = {e.id: e for e in log if isinstance(e, events.Action)}
    assert sorted(a.agent or "" for a in actions.values()) == ["alice"] * ACTIONS + ["bob"] * ACTIONS
    for agent, answers in results.items():
        assert all(actions[action_id].agent == agent for action_id, _ in answers)
    # The agents really interleaved: neither ran all of its actions before the other began.
    order = [a.agent for a in sorted(actions.values(), key=lambda a: a.id or 0)]
    assert order[:ACTIONS] != ["alice"] * ACTIONS
    assert order[:ACTIONS] != ["bob"] * ACTIONS
    causes = [e.cause for e in log if isinstance(e, events.Observation)]
    assert sorted(causes) == sorted(actions)


async def test_agents_on_separate_sessions_run_side_by_side(bus: Bus, worker: WorkerProcess) -> None:
    results: dict[str, list[tuple[int, events.Event]]] = {}
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for n in range(4):
                tg.start_soon(drive, bus, f"own-{n}", f"agent{n}", results)
    for n in range(4):
        agent = f"agent{n}"
        check_own_answers(agent, results[agent])
        log = await bus.session(f"own-{n}").events()
        assert {e.agent for e in log if isinstance(e, events.Action)} == {agent}
        assert len(log) == 2 * ACTIONS

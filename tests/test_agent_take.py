"""Taking a session again: the agent role keeps the fold of a session it let go (its run
ended), so the session's next run on the same worker reads only the log after it, and its
prompt is the one the whole log makes; a log made again under the same id is read whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, open_run
from riverbed.agent.llm import build_messages
from riverbed.client.session import Bus
from riverbed.workers.agent_role import AgentHandler
from tests.kit.agent_role import ended, roles, scrape, server
from tests.kit.metrics import value
from tests.kit.openai_server import OpenAIServer

pytestmark = pytest.mark.anyio

__all__ = ["server"]  # the fixture this module shares


async def run_once(bus: Bus, agent: AgentHandler, session: str, task: str) -> list[events.Event]:
    """A run of two steps (a thought, then the finish), and the session let go after it."""
    opened = await open_run(bus, session, task, limits=RunLimits(max_steps=5))
    seen = await ended(bus, session, opened.opened)
    assert isinstance(seen[-1], events.Finish), seen[-1]
    with anyio.fail_after(30):  # (let go once the loop sees the run ended)
        while session in agent.sessions:
            await anyio.sleep(0.05)
    return seen


def assert_the_logs_prompt(log: list[events.Event], response: events.LlmResponse, request: dict[str, Any]) -> None:
    """The model was asked, for ``response``, the prompt the log up to its cause makes."""
    assert response.cause is not None
    before = [e for e in log if (e.id or 0) <= response.cause]
    assert json.loads(json.dumps(build_messages(before))) == request["messages"]


def answers(server: OpenAIServer, runs: int) -> None:
    for _ in range(runs):
        server.reply(tool_calls=[("think", {"thought": "a thought"})])
        server.reply(tool_calls=[("finish", {"final_thought": "done"})])


async def test_the_next_run_reads_only_the_log_after_the_kept_fold(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    answers(server, 2)
    session = bus.session("kept")
    async with roles(bus, workspace, server) as agent:
        await run_once(bus, agent, "kept", "the first task")
        first = await session.last_id()
        await run_once(bus, agent, "kept", "the second task")
        scraped = scrape(bus, agent)
    log = await session.events()
    assert value(scraped, "riverbed_agent_sessions_taken_total") == 2
    assert value(scraped, "riverbed_agent_sessions_taken_kept_total") == 1
    # The first take read the run's opening; the second only what came after the first run.
    read = value(scraped, "riverbed_agent_take_events_read_total")
    assert read < first + 5, (read, first)
    # Every prompt of the second run is the one the log up to it makes, the first run included.
    second = [e for e in log if isinstance(e, events.LlmResponse)][2:]
    assert len(second) == len(server.requests[2:]) == 2
    for response, request in zip(second, server.requests[2:], strict=True):
        assert_the_logs_prompt(log, response, request)
    assert "the first task" in json.dumps(server.requests[-1]["messages"])


async def test_a_log_made_again_under_the_same_id_is_read_whole(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    answers(server, 2)
    session = bus.session("again")
    async with roles(bus, workspace, server) as agent:
        await run_once(bus, agent, "again", "the lost task")
        # Redis lost the session (its keys gone): the next append makes a new log under the id.
        lost = [key async for key in bus.redis.scan_iter(match=f"{bus.keys.prefix}:*{{again}}*")]
        assert lost
        await bus.redis.delete(*lost)
        await run_once(bus, agent, "again", "the new task")
        scraped = scrape(bus, agent)
    assert value(scraped, "riverbed_agent_sessions_taken_kept_total") == 0
    log = await session.events()
    assert "the lost task" not in json.dumps(server.requests[-1]["messages"])
    assert_the_logs_prompt(log, [e for e in log if isinstance(e, events.LlmResponse)][-1], server.requests[-1])

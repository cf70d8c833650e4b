"""The agent role in-process against the scripted OpenAI-compatible server, with a real runtime
role and Redis: runs opened on the log end with finish, step_limit, budget_exhausted,
llm_error or cancelled; a session is announced to the role only when a run opens, and retired
once it ended."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, cancel_run, list_runs, open_run
from riverbed.agent.replay import fork
from riverbed.agent.tools import ROLE_TOOL_ACTIONS, tools
from riverbed.bus.keys import AGENT_ROLE
from riverbed.client.session import Bus
from riverbed.errors import InputError
from tests.kit.agent_role import (
    ended,
    roles,
    scrape,
    server,  # noqa: F401  (fixtures)
)
from tests.kit.metrics import value
from tests.kit.openai_server import OpenAIServer

pytestmark = pytest.mark.anyio


async def test_a_run_works_through_tool_calls_to_finish(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    server.reply(tool_calls=[("cmd_run", {"command": "echo hello > a.txt"}), ("cmd_run", {"command": "cat a.txt"})])
    server.reply(tool_calls=[("finish", {"final_thought": "wrote a.txt"})])
    async with roles(bus, workspace, server) as agent:
        opened = await open_run(bus, "s1", "write a file", limits=RunLimits(max_steps=5))
        seen = await ended(bus, "s1", opened.task)
    kinds = [e.kind for e in seen]
    assert kinds == [
        "message",
        "run_started",
        "llm_response",
        "cmd_run",
        "cmd_output",
        "cmd_run",
        "cmd_output",
        "llm_response",
        "finish",
    ]
    outputs = [e for e in seen if isinstance(e, events.CmdOutput)]
    assert outputs[1].content.strip() == "hello"
    assert len(server.requests) == 2
    # The second prompt holds the first step's calls and results.
    assert "hello" in server.prompts()[1]
    rows = await list_runs(bus)
    assert [(r.session, r.state, r.steps) for r in rows] == [("s1", "finished", 2)]
    scraped = scrape(bus, agent)
    assert value(scraped, "riverbed_agent_runs_ended_total", reason="finish") == 1
    assert value(scraped, "riverbed_agent_model_calls_total") == 2
    assert value(scraped, "riverbed_agent_model_failures_total") == 0
    assert rows[0].tokens > 0
    assert rows[0].worker is None
    assert await list_runs(bus, state="running") == []


async def test_the_model_receives_the_request_as_the_role_built_it(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    # The role hands the client its request as the body's extra part (the client's own typed
    # pass over it costs more CPU than the rest of a step): the wire carries every field.
    server.reply("all done")
    async with roles(bus, workspace, server):
        opened = await open_run(bus, "s-wire", "say hello")
        await ended(bus, "s-wire", opened.opened)
    (request,) = server.requests
    assert request["model"] == "test-model"
    assert request["tools"] == tools(ROLE_TOOL_ACTIONS)  # the reference agent's: every built-in tool
    assert (request["tool_choice"], request["parallel_tool_calls"]) == ("auto", True)  # delegates run in parallel
    assert request["messages"][0]["role"] == "system"
    assert request["messages"][-1] == {"role": "user", "content": "say hello"}


async def test_a_second_run_is_refused_while_one_is_open(bus: Bus) -> None:
    await open_run(bus, "s2", "one")
    with pytest.raises(InputError, match="has a run open already"):
        await open_run(bus, "s2", "two")
    (row,) = await list_runs(bus)  # not picked up by an agent worker: folded from its log
    assert (row.session, row.state, row.worker) == ("s2", "waiting", None)


async def test_the_step_limit_ends_a_run(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    for i in range(2):
        server.reply(tool_calls=[("think", {"thought": f"step {i}"})])
    async with roles(bus, workspace, server):
        opened = await open_run(bus, "s3", "think forever", limits=RunLimits(max_steps=2))
        seen = await ended(bus, "s3", opened.opened)
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert last.source == "agent"
    assert last.reason == "step_limit"
    assert len(server.requests) == 2
    assert server.unexpected == 0


async def test_a_budget_ends_a_run_after_at_most_one_call_over(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    usage = {"prompt_tokens": 1000, "completion_tokens": 10, "total_tokens": 1010}
    for _ in range(3):
        server.reply(tool_calls=[("think", {"thought": "spend"})], usage=usage)
    prices = '{"test-model": {"prompt": 1.0, "completion": 1.0}}'  # 1010 tokens: 0.00101 USD a call
    async with roles(bus, workspace, server, prices=prices):
        opened = await open_run(bus, "s4", "spend", limits=RunLimits(max_steps=10, max_cost=0.0015))
        seen = await ended(bus, "s4", opened.opened)
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert last.reason == "budget_exhausted"
    assert "USD" in last.content
    assert len(server.requests) == 2  # the second call went over the budget; no third
    (row,) = await list_runs(bus, state="failed")
    assert row.cost is not None
    assert row.cost > 0.0015
    assert row.steps == 2


@pytest.mark.parametrize("checked", [True, False], ids=["worker-client", "library-client"])
async def test_a_server_answering_500_ends_the_run_with_llm_error(
    bus: Bus, workspace: Path, server: OpenAIServer, checked: bool
) -> None:
    server.fail(500, "the GPU caught fire", times=50)
    async with roles(bus, workspace, server, retry_seconds=1.5, checked=checked) as agent:
        opened = await open_run(bus, "s5", "try")
        seen = await ended(bus, "s5", opened.opened)
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert last.reason == "llm_error"
    assert "HTTP 500" in last.content
    assert "the GPU caught fire" in last.content
    assert len(server.requests) >= 2  # retried with backoff before giving up
    assert not any(isinstance(e, events.LlmResponse) for e in seen)
    scraped = scrape(bus, agent)
    assert value(scraped, "riverbed_agent_runs_ended_total", reason="llm_error") == 1
    assert value(scraped, "riverbed_agent_model_failures_total") == len(server.requests)


async def test_a_server_that_recovers_is_retried(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    server.fail(503, "overloaded", times=2)
    server.reply("done")
    async with roles(bus, workspace, server):
        opened = await open_run(bus, "s6", "try")
        seen = await ended(bus, "s6", opened.opened)
    assert isinstance(seen[-1], events.Finish)
    assert seen[-1].final_thought == "done"
    assert len(server.requests) == 3


async def test_cancel_ends_the_run(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    server.reply(tool_calls=[("cmd_run", {"command": "sleep 3", "timeout": 30})])
    async with roles(bus, workspace, server):
        opened = await open_run(bus, "s7", "wait")
        with anyio.fail_after(20):
            async for event in bus.session("s7").log(opened.opened, follow=True):
                if isinstance(event, events.CmdRun):
                    break
        await cancel_run(bus, "s7", note="enough")
        seen = await ended(bus, "s7", opened.opened)
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert last.source == "agent"
    assert last.reason == "cancelled"
    assert len(server.requests) == 1
    with pytest.raises(InputError, match="no open run"):
        await cancel_run(bus, "s7")
    (row,) = await list_runs(bus, state="cancelled")
    assert row.session == "s7"


async def test_only_sessions_with_a_run_are_announced_to_the_agent_role(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    directory = bus.keys.directory(AGENT_ROLE)
    session = bus.session("plain")
    await session.append(events.Message(content="no run here", source="user"))
    assert await bus.client.xlen(directory) == 0
    server.reply("ok")
    async with roles(bus, workspace, server) as agent:
        opened = await open_run(bus, "plain", "now a run")
        await ended(bus, "plain", opened.opened)
        # Once the run ended the session is retired: released, and not marked as needing the role.
        with anyio.fail_after(10):
            while "plain" in agent.sessions:
                await anyio.sleep(0.02)
        meta = await bus.log_store.meta("plain")
        assert meta.get(f"holder:{AGENT_ROLE}") == ""
        assert f"need:{AGENT_ROLE}" not in meta
        before = await bus.client.xlen(directory)
        await session.append(events.Message(content="later", source="user"))
        await anyio.sleep(0.3)
        assert "plain" not in agent.sessions
        assert await bus.client.xlen(directory) == before


async def test_cancel_gives_up_a_model_call_in_flight(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    server.reply("too late", delay=10)
    async with roles(bus, workspace, server):
        opened = await open_run(bus, "s8", "think slowly")
        with anyio.fail_after(10):
            while not server.requests:
                await anyio.sleep(0.02)
        await cancel_run(bus, "s8")
        seen = await ended(bus, "s8", opened.opened, timeout=3)  # well before the model answers
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert last.reason == "cancelled"
    assert not any(isinstance(e, events.LlmResponse) for e in seen)


async def test_a_tenant_opens_and_cancels_a_run_on_its_session(bus: Bus) -> None:
    opened = await open_run(bus, "t1", "a tenant's task", tenant="acme")
    assert await cancel_run(bus, "t1", tenant="acme") == opened.opened + 1
    log = await bus.session("t1").events()
    assert {e.tenant for e in log} == {"acme"}


async def test_a_fork_taken_mid_run_does_not_continue_the_run(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    opened = await open_run(bus, "src", "the source's task")
    await fork(bus, "src", opened.opened, "copy", workspace="empty")
    server.reply("done")  # one model call: the source's
    async with roles(bus, workspace, server) as agent:
        seen = await ended(bus, "src", opened.opened)
        assert isinstance(seen[-1], events.Finish)
        with anyio.fail_after(10):  # the fork was announced (its copy holds run_started), then retired
            while await bus.log_store.meta("copy") and "copy" in agent.sessions:
                await anyio.sleep(0.02)
    assert len(server.requests) == 1
    (row,) = [r for r in await list_runs(bus) if r.session == "copy"] or [None]
    copy_log = await bus.session("copy").events()
    assert not any(isinstance(e, events.LlmResponse) for e in copy_log)
    assert row is None or row.state == "cancelled"

"""``RIVERBED_AGENT_MAX_DEPTH=0`` turns delegation off: the model is not offered ``delegate``,
so no step is spent on a call that would be refused (the agent role in-process, the scripted
model server, a real runtime role and Redis)."""

from __future__ import annotations

from pathlib import Path

import pytest

from riverbed import events
from riverbed.agent.hosted import open_run
from riverbed.client.session import Bus
from riverbed.runtime import Runtime
from riverbed.settings import Settings
from riverbed.workers.agent_role import build_agent_handler
from riverbed.workers.runtime_role import RuntimeHandler
from tests.kit.agent_role import ended, server  # noqa: F401  (server: a fixture)
from tests.kit.agents import owners
from tests.kit.openai_server import OpenAIServer

pytestmark = pytest.mark.anyio


def offered(request: dict[str, object]) -> list[str]:
    tools = request["tools"]
    assert isinstance(tools, list)
    return [tool["function"]["name"] for tool in tools]


async def run_once(bus: Bus, workspace: Path, server: OpenAIServer, session: str, env: dict[str, str]) -> list[str]:
    """One run on an agent role configured by ``env``: the tools the model was offered."""
    model = {"openai_base_url": server.base_url, "openai_api_key": "test-key", "llm_model": "test-model"}
    agent = build_agent_handler(Settings.from_env(env, **model))
    server.reply(tool_calls=[("finish", {"final_thought": "did it myself"})])
    runtime = Runtime(workspace_root=workspace)
    try:
        async with owners(bus, [RuntimeHandler(runtime), agent]):
            opened = await open_run(bus, session, "count the words of a.txt")
            seen = await ended(bus, session, opened.task)
    finally:
        await runtime.aclose()
        await agent.aclose()
    assert isinstance(seen[-1], events.Finish)
    return offered(server.requests[-1])


async def test_depth_0_offers_no_delegate_and_the_default_does(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    assert "delegate" in await run_once(bus, workspace, server, "default", {})
    names = await run_once(bus, workspace, server, "alone", {"RIVERBED_AGENT_MAX_DEPTH": "0"})
    assert "delegate" not in names
    assert {"cmd_run", "python_run", "finish"} <= set(names)  # the rest of the tools are there
    assert len(server.requests) == 2

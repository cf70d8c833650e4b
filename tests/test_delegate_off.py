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


async def test_depth_0_offers_no_delegate_and_the_default_does(bus: Bus, workspace: Path, server: OpenAIServer) -> None:
    model = {"openai_base_url": server.base_url, "openai_api_key": "test-key", "llm_model": "test-model"}
    default = build_agent_handler(Settings.from_env({}, **model))
    assert "delegate" in [tool["function"]["name"] for tool in default.tools]
    await default.aclose()

    off = build_agent_handler(Settings.from_env({"RIVERBED_AGENT_MAX_DEPTH": "0"}, **model))
    server.reply(tool_calls=[("finish", {"final_thought": "did it myself"})])
    runtime = Runtime(workspace_root=workspace)
    try:
        async with owners(bus, [RuntimeHandler(runtime), off]):
            opened = await open_run(bus, "alone", "count the words of a.txt")
            seen = await ended(bus, "alone", opened.task)
    finally:
        await runtime.aclose()
        await off.aclose()
    assert isinstance(seen[-1], events.Finish)
    (request,) = server.requests
    names = offered(request)
    assert "delegate" not in names
    assert {"cmd_run", "python_run", "finish"} <= set(names)  # the rest of the tools are there

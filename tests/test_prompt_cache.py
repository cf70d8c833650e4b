"""Prompt caching: the prompt's prefix stays byte-identical between steps, and across a
condensation up to what it forgot; cache breakpoints behind RIVERBED_PROMPT_CACHE.

Every request the scripted server receives during an agent run that gets condensed is
recorded; the common prefix of consecutive requests is measured in bytes of their JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from riverbed import events
from riverbed.agent.llm import build_messages
from riverbed.agent.messages import cache_breakpoints
from riverbed.agent.usage import usage
from riverbed.client.session import Bus
from riverbed.errors import ConfigError, InputError
from riverbed.settings import Settings
from riverbed.workers.condenser_role import CondenserHandler
from tests.kit.agents import roles, run_scripted_agent
from tests.kit.embedder import shared_local
from tests.kit.openai_server import OpenAIServer, server, shared_prefix  # noqa: F401  (server: a fixture)

pytestmark = pytest.mark.anyio

CONDENSER = {"strategy": "amortized", "max_events": 14, "keep_first": 3}


def prompt_text(request: dict[str, Any]) -> str:
    """The request as a provider caches it: tools, then the messages, in order."""
    return json.dumps([request["tools"], request["messages"]], sort_keys=True)


def stable_head(request: dict[str, Any]) -> str:
    return json.dumps([request["tools"], request["messages"][0]], sort_keys=True)


async def run_agent(bus: Bus, server: OpenAIServer, workspace: Path, database_url: str, prefix: str, **s: Any) -> Any:
    session = bus.session("cache")
    await session.append(events.SessionConfig(condenser=CONDENSER, source="user"))
    async with roles(bus, workspace, database_url, prefix, shared_local(), CondenserHandler(llm=None, model=None)):
        ended = await run_scripted_agent(
            bus, server, "cache", "Run the steps one by one.", [f"echo step {i}" for i in range(10)], **s
        )
    assert isinstance(ended, events.Finish)
    return await session.events()


async def test_the_prefix_only_grows_between_steps_and_the_head_never_changes(
    bus: Bus, server: OpenAIServer, workspace: Path, database_url: str, prefix: str
) -> None:
    log = await run_agent(bus, server, workspace, database_url, prefix)
    responses = [e for e in log if isinstance(e, events.LlmResponse)]
    assert len(responses) == len(server.requests) == 11
    condensed_at = [e.id for e in log if isinstance(e, events.Condensation)]
    assert condensed_at, "the run was meant to be condensed"

    shrank: list[int] = []
    grew = 0
    for i, (before, after) in enumerate(zip(server.requests, server.requests[1:], strict=False)):
        # Tools and system prompt: byte-identical in every request.
        assert stable_head(before) == stable_head(after)
        a, b = prompt_text(before), prompt_text(after)
        shared = shared_prefix(a, b)
        between = [c for c in condensed_at if responses[i].cause < c <= responses[i + 1].cause]  # type: ignore[operator]
        if not between:
            # No condensation in between: the whole earlier prompt is the start of the next
            # (all but the closing brackets of the JSON array).
            assert shared >= len(a) - 2, (i, a[shared - 40 : shared + 40], b[shared - 40 : shared + 40])
            grew += 1
        else:
            shrank.append(i)
            # A condensation changes the prompt from what it forgot on; what it kept first
            # (tools, system prompt, the task) is still shared.
            task = json.dumps(before["messages"][1], sort_keys=True)
            assert task in a[:shared]
    assert shrank, "a condensation happened between two requests"
    assert grew >= 5
    # The provider reports the shared prefix as cached; it is recorded in the log.
    report = usage(log, {})
    assert report.cached_tokens > 0
    assert all(step.cached_tokens > 0 for step in report.steps[1:])
    # The condenser's effect: the view's tokens before and after each condensation.
    assert [m.event_id for m in report.condensations] == condensed_at
    for mark in report.condensations:
        assert mark.source == "condenser"
        assert mark.tokens_after <= mark.tokens_before
        assert mark.events_after <= mark.events_before
    assert any(mark.tokens_after < mark.tokens_before for mark in report.condensations)


def test_usage_marks_each_condensation_with_the_view_before_and_after() -> None:
    raw: list[events.Event] = [
        events.Message(source="user", content="task " * 50),
        events.LlmResponse(model="m", usage={"prompt_tokens": 100, "completion_tokens": 5}),
        events.Think(thought="long thought " * 100),
        events.Condensation(forgotten=[(3, 3)], summary="thought a lot"),
        events.LlmResponse(model="m", usage={"prompt_tokens": 40, "completion_tokens": 5}),
    ]
    log = [events.with_id(e, i) for i, e in enumerate(raw, 1)]
    report = usage(log)
    (mark,) = report.condensations
    assert (mark.event_id, mark.source, mark.events_before, mark.events_after) == (4, "condenser", 3, 3)
    assert mark.tokens_after < mark.tokens_before
    assert [s.event_id for s in report.steps] == [2, 5]


async def test_anthropic_breakpoints_mark_the_system_message_and_the_last_one(
    bus: Bus, server: OpenAIServer, workspace: Path, database_url: str, prefix: str
) -> None:
    log = await run_agent(bus, server, workspace, database_url, prefix, prompt_cache="anthropic")
    responses = [e for e in log if isinstance(e, events.LlmResponse)]
    for request, response in zip(server.requests, responses, strict=True):
        messages = request["messages"]
        assert messages[0]["content"][-1]["cache_control"] == {"type": "ephemeral"}
        assert messages[-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
        marked = [m for m in messages if isinstance(m.get("content"), list)]
        assert len(marked) == 2
        # The same text as without breakpoints.
        plain = json.loads(json.dumps(build_messages([e for e in log if (e.id or 0) <= (response.cause or 0)])))
        assert [_text(m) for m in messages] == [_text(m) for m in plain]


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return str(content)


def test_breakpoints_are_pure_and_leave_empty_content_alone() -> None:
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]},
    ]
    assert cache_breakpoints(messages, "none") is messages
    marked = cache_breakpoints(messages)
    assert marked[0]["content"] == [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]
    assert marked[1] == messages[1]
    assert marked[2] == messages[2]  # empty content: no part to mark
    assert messages[0]["content"] == "sys"  # the input is not changed
    with pytest.raises(InputError):
        cache_breakpoints(messages, "bogus")
    with pytest.raises(ConfigError, match="RIVERBED_PROMPT_CACHE"):
        Settings.from_env({"RIVERBED_PROMPT_CACHE": "bogus"})


async def test_riverbed_usage_shows_a_row_at_each_condensation(bus: Bus, cli_env: dict[str, str]) -> None:
    from tests.kit.cli import ok  # noqa: PLC0415

    session = bus.session("marks")
    await session.append(
        events.Message(source="user", content="task " * 50),
        events.LlmResponse(model="m", usage={"prompt_tokens": 100, "completion_tokens": 5}),
        events.Think(thought="long thought " * 100),
        events.Condensation(forgotten=[(3, 3)], summary="thought a lot"),
        events.LlmResponse(model="m", usage={"prompt_tokens": 40, "completion_tokens": 5}),
    )
    document = json.loads(ok(cli_env, "usage", "marks", "--json"))
    (mark,) = document["condensations"]
    assert mark["event_id"] == 4
    assert mark["tokens_after"] < mark["tokens_before"]
    lines = ok({**cli_env, "COLUMNS": "200"}, "usage", "marks").decode().splitlines()
    rows = [line for line in lines if "condensation" in line or line.strip().startswith(("│ 2 ", "│ 5 "))]
    assert len(rows) == 3
    assert "condensation" in rows[1]
    assert f"view {mark['tokens_before']} → {mark['tokens_after']} tokens" in rows[1]

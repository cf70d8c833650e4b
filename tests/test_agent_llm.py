"""The reference LLM agent against a scripted OpenAI-compatible server, through the real
``openai`` client, with real runtime and memory workers in-process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

import riverbed
from riverbed import events
from riverbed.agent.llm import AgentOptions, build_messages, make_client, render
from riverbed.agent.tools import ROLE_TOOL_ACTIONS, action_from_call, tool_names, tools
from riverbed.client.session import Bus
from riverbed.errors import ConfigError, InputError
from riverbed.runtime.paths import workspace_name
from riverbed.settings import Settings
from riverbed.workers.agent_run import run_llm_agent
from tests.kit.agents import roles, workers  # noqa: F401  (fixtures)
from tests.kit.openai_server import OpenAIServer, server  # noqa: F401  (server: a fixture)

pytestmark = pytest.mark.anyio

SETTINGS = Settings(llm_model="test-model", agent_llm_retry_seconds=0)
"""(a model call that fails ends the run: the retries are the agent role's tests')"""
NO_RETRY = SETTINGS


def seed_workspace(workspace: Path, session: str) -> Path:
    root = workspace / workspace_name(session)
    (root / ".riverbed" / "microagents").mkdir(parents=True)
    (root / "AGENTS.md").write_text("Keep notes short and in plain text.\n")
    (root / ".riverbed" / "microagents" / "docker.md").write_text(
        "---\nname: docker\ntype: knowledge\ntriggers: [docker]\n---\nThe sandbox has no docker daemon.\n"
    )
    return root


def wire(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as they travel (JSON), to compare with what the server received."""
    result: list[dict[str, Any]] = json.loads(json.dumps(messages))
    return result


# --- tools and prompts (pure) ------------------------------------------------------------


def test_tools_are_the_action_kinds_without_event_fields() -> None:
    specs = tools()
    assert tool_names() == [s["function"]["name"] for s in specs]
    assert tool_names() == [
        "cmd_run",
        "file_read",
        "file_write",
        "file_edit",
        "python_run",
        "recall",
        "think",
        "finish",
    ]
    for spec in specs:
        params = spec["function"]["parameters"]
        assert params["type"] == "object"
        assert not {"id", "kind", "source", "cause", "ts", "agent", "tenant", "trace", "v"} & set(params["properties"])
        assert spec["function"]["description"]
    by_name = {s["function"]["name"]: s["function"]["parameters"] for s in specs}
    assert by_name["cmd_run"]["required"] == ["command"]
    assert set(by_name["file_edit"]["properties"]["command"]["enum"]) == {
        "view",
        "create",
        "str_replace",
        "insert",
        "undo_edit",
    }
    assert by_name["recall"]["properties"]["recall_type"]["enum"] == ["knowledge", "semantic", "workspace_context"]


def test_tool_calls_become_actions_or_clear_errors() -> None:
    action = action_from_call("file_read", '{"path": "a.txt", "start": 3}')
    assert action == events.FileRead(path="a.txt", start=3, ts=action.ts)
    for name, arguments, pattern in [
        ("rm_rf", "{}", "there is no tool 'rm_rf'"),
        ("cmd_run", "{not json", "not a JSON object"),
        ("cmd_run", "[1]", "not a JSON object"),
        ("cmd_run", "{}", "bad arguments for cmd_run"),
        ("cmd_run", '{"command": "ls", "cause": 3}', "does not take cause"),
    ]:
        with pytest.raises(InputError, match=pattern):
            action_from_call(name, arguments)


def test_templates_render_and_ship_with_the_package() -> None:
    text = render("system.j2", agent="tester", instructions="Be brief.")
    assert text.startswith("You are tester")
    assert text.endswith("Be brief.")
    assert "{{" not in render("system.j2", agent="x", instructions=None)
    knowledge = render(
        "knowledge.j2", knowledge=[events.Knowledge(name="docker", trigger="docker", content="No daemon.")]
    )
    assert '<knowledge name="docker" trigger="docker">' in knowledge
    assert "No daemon." in knowledge
    context = render("workspace_context.j2", ctx=events.RecallResult(recall_type="workspace_context", date="today"))
    assert "Today's date: today" in context
    prompts = Path(riverbed.__file__).parent / "agent" / "prompts"
    assert sorted(p.name for p in prompts.glob("*.j2")) == [
        "agent.j2",
        "knowledge.j2",
        "system.j2",
        "workspace_context.j2",
    ]


def test_a_client_needs_a_key_or_a_base_url() -> None:
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        make_client(Settings())
    assert str(make_client(Settings(openai_base_url="http://127.0.0.1:9/v1")).base_url).startswith("http://127.0.0.1")


# --- the loop -----------------------------------------------------------------------------


async def test_a_recorded_run_with_tools_and_replay_without_the_model(
    bus: Bus, server: OpenAIServer, workers: None, workspace: Path
) -> None:
    root = seed_workspace(workspace, "llm-1")
    first = server.reply(tool_calls=[("cmd_run", {"command": "echo hello from the shell"})])
    second = server.reply("Writing the notes.", tool_calls=[("file_write", {"path": "notes.txt", "content": "ok\n"})])
    third = server.reply(tool_calls=[("finish", {"final_thought": "notes written", "outputs": {"file": "notes.txt"}})])

    final = await run_llm_agent(
        bus, "llm-1", "Write notes about docker.", settings=SETTINGS, client=server.client(), max_steps=5
    )

    assert isinstance(final, events.Finish)
    assert final.final_thought == "notes written"
    assert final.outputs == {"file": "notes.txt"}
    assert (root / "notes.txt").read_text() == "ok\n"
    assert server.unexpected == 0
    assert len(server.requests) == 3

    session = bus.session("llm-1")
    log = await session.events()
    assert [e.kind for e in log] == [
        "message",
        "run_started",
        "recall",
        "recall",
        "recall_result",
        "recall_result",
        "llm_response",
        "cmd_run",
        "cmd_output",
        "llm_response",
        "file_write",
        "file_written",
        "llm_response",
        "finish",
    ]
    task = log[0]
    assert isinstance(task, events.Message)
    assert (task.source, task.content) == ("user", "Write notes about docker.")
    recalls = [e for e in log if isinstance(e, events.Recall)]
    assert [r.recall_type for r in recalls] == ["workspace_context", "knowledge"]
    assert all(r.cause == task.id and r.agent == "llm" for r in recalls)
    (context,) = [e for e in log if isinstance(e, events.RecallResult) and e.recall_type == "workspace_context"]
    assert context.repo_instructions is not None
    (knowledge,) = [e for e in log if isinstance(e, events.RecallResult) and e.recall_type == "knowledge"]
    assert [k.name for k in knowledge.knowledge] == ["docker"]

    # Every response is recorded before its actions, which point back at it.
    responses = [e for e in log if isinstance(e, events.LlmResponse)]
    for response, calls, action in zip(responses, [first, second, third], log[7::3], strict=True):
        assert response.model == "test-model"
        assert [c["id"] for c in response.tool_calls] == [c["id"] for c in calls]
        assert response.tool_calls[0]["function"]["name"] == action.kind
        assert action.cause == response.id
        assert isinstance(action, events.Action)
        assert action.tool_call_id == calls[0]["id"]  # the call it answers, by identity
        assert (response.id or 0) < (action.id or 0)
        assert response.usage["total_tokens"] >= 0
    assert responses[1].content == "Writing the notes."
    output = log[8]
    assert isinstance(output, events.CmdOutput)
    assert output.content.strip() == "hello from the shell"

    # The first prompt: system, the task, the rendered workspace context and knowledge.
    request = server.requests[0]
    assert request["model"] == "test-model"
    assert [t["function"]["name"] for t in request["tools"]] == tool_names(ROLE_TOOL_ACTIONS)
    roles_sent = [m["role"] for m in request["messages"]]
    assert roles_sent == ["system", "user", "user", "user"]
    assert "<workspace_context>" in request["messages"][2]["content"]
    assert "Keep notes short" in request["messages"][2]["content"]
    assert '<knowledge name="docker"' in request["messages"][3]["content"]
    # The second prompt carries the first tool call under the model's own id, and its result.
    later = server.requests[1]["messages"]
    assert later[-2]["tool_calls"][0]["id"] == first[0]["id"]
    # Strict OpenAI-compatible servers refuse "content": null, even next to tool calls.
    assert later[-2]["content"] == ""
    assert all(isinstance(m.get("content"), str) for r in server.requests for m in r["messages"])
    assert later[-1] == {"role": "tool", "tool_call_id": first[0]["id"], "content": output.content + "\n[exit code 0]"}

    # Replay with no model: the server is gone, and every prompt is rebuilt from the log.
    server.stop()
    for response, sent in zip(responses, server.requests, strict=True):
        assert response.cause is not None
        assert wire(build_messages([e for e in log if (e.id or 0) <= response.cause])) == sent["messages"]
    last = log[-1].id
    assert last is not None
    for n in range(1, last + 1):
        view = await session.view(until=n)
        assert [e.id for e in view] == [e.id for e in log if (e.id or 0) <= n]
        build_messages([e for e in log if (e.id or 0) <= n])


async def test_an_llm_failure_is_an_error_in_the_log_and_ends_the_run(
    bus: Bus, server: OpenAIServer, workers: None
) -> None:
    server.fail(500, "the model is on fire")
    final = await run_llm_agent(bus, "llm-500", "Do something.", settings=NO_RETRY, client=server.client())
    assert isinstance(final, events.Error)
    assert final.source == "agent"
    assert final.reason == "llm_error"
    assert final.retryable
    assert "HTTP 500" in final.content
    assert "the model is on fire" in final.content
    log = await bus.session("llm-500").events()
    assert log[-1] == final
    assert not any(isinstance(e, events.LlmResponse) for e in log)
    assert len(server.requests) == 1


async def test_an_unreachable_model_is_an_error_too(bus: Bus, workers: None) -> None:
    with OpenAIServer() as gone:
        client = gone.client()
    final = await run_llm_agent(bus, "llm-gone", "Hello?", settings=NO_RETRY, client=client)
    assert isinstance(final, events.Error)
    assert final.reason == "llm_error"
    assert final.retryable


async def test_a_bad_tool_call_is_reported_to_the_model_which_tries_again(
    bus: Bus, server: OpenAIServer, workers: None
) -> None:
    server.reply(tool_calls=[("cmd_run", {"cmd": "ls"})])
    server.reply(tool_calls=[("finish", {"final_thought": "fixed"})])
    final = await run_llm_agent(bus, "llm-bad", "List files.", settings=SETTINGS, client=server.client())
    assert isinstance(final, events.Finish)
    log = await bus.session("llm-bad").events()
    response = next(e for e in log if isinstance(e, events.LlmResponse))
    error = next(e for e in log if isinstance(e, events.Error))
    assert (error.reason, error.cause, error.source) == ("bad_tool_call", response.id, "agent")
    assert "bad arguments for cmd_run" in error.content
    assert not any(isinstance(e, events.CmdRun) for e in log)
    assert "bad arguments for cmd_run" in server.requests[1]["messages"][-1]["content"]


async def test_a_text_answer_ends_the_run_and_the_next_message_recalls_knowledge(
    bus: Bus, server: OpenAIServer, workers: None
) -> None:
    # A text answer ends the run (the agent role's rule): its text is the run's final word.
    server.reply("Which file do you mean?")
    asked = await run_llm_agent(bus, "llm-chat", "Fix the file.", settings=SETTINGS, client=server.client())
    assert isinstance(asked, events.Finish)
    assert (asked.source, asked.final_thought) == ("agent", "Which file do you mean?")

    server.reply(tool_calls=[("think", {"thought": "the user means app.py"})])
    server.reply(tool_calls=[("finish", {})])
    final = await run_llm_agent(bus, "llm-chat", "The one about docker.", settings=SETTINGS, client=server.client())
    assert isinstance(final, events.Finish)
    log = await bus.session("llm-chat").events()
    recalls = [(e.recall_type, e.query) for e in log if isinstance(e, events.Recall)]
    assert recalls == [
        ("workspace_context", ""),
        ("knowledge", "Fix the file."),
        ("knowledge", "The one about docker."),
    ]
    third = server.requests[2]["messages"]
    assert {"role": "assistant", "content": "Which file do you mean?"} in third
    assert {"role": "assistant", "content": "the user means app.py"} in third


async def test_the_step_limit_ends_the_run(bus: Bus, server: OpenAIServer, workers: None) -> None:
    for i in range(2):
        server.reply(tool_calls=[("cmd_run", {"command": f"echo {i}"})])
    final = await run_llm_agent(
        bus,
        "llm-steps",
        "Loop.",
        settings=SETTINGS,
        client=server.client(),
        max_steps=2,
        options=AgentOptions(name="looper"),
    )
    assert isinstance(final, events.Error)
    assert final.reason == "step_limit"
    log = await bus.session("llm-steps").events()
    assert sum(isinstance(e, events.CmdOutput) for e in log) == 2
    assert {e.agent for e in log if isinstance(e, events.Action) and e.source == "agent"} == {"looper"}
    with pytest.raises(InputError, match="max_steps"):
        await run_llm_agent(bus, "llm-steps", "x", settings=SETTINGS, client=server.client(), max_steps=0)


async def test_a_user_message_during_the_run_gets_its_knowledge_recall(
    bus: Bus, server: OpenAIServer, workers: None, workspace: Path
) -> None:
    seed_workspace(workspace, "llm-live")
    server.reply(tool_calls=[("think", {"thought": "planning"})], delay=0.3)
    server.reply(tool_calls=[("finish", {})])
    result: list[events.Event | None] = []

    async def agent() -> None:
        result.append(await run_llm_agent(bus, "llm-live", "Plan the work.", settings=SETTINGS, client=server.client()))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent)
            while not server.requests:
                await anyio.sleep(0.01)
            await bus.session("llm-live").append(events.Message(source="user", content="Also check docker."))
    assert isinstance(result[0], events.Finish)
    log = await bus.session("llm-live").events()
    recalls = [(e.recall_type, e.query) for e in log if isinstance(e, events.Recall)]
    assert recalls[-1] == ("knowledge", "Also check docker.")
    late = server.requests[1]["messages"]
    assert {"role": "user", "content": "Also check docker."} in late
    assert late[-1]["role"] == "user"
    assert '<knowledge name="docker"' in late[-1]["content"]


# --- usage ----------------------------------------------------------------------------------


def test_usage_reads_provider_fields_and_prices_them() -> None:
    from riverbed.agent.usage import parse_prices, tokens, usage  # noqa: PLC0415

    assert tokens({"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 60}}) == (
        100,
        60,
        7,
    )
    assert tokens({"input_tokens": 10, "output_tokens": 2, "cache_read_input_tokens": 4}) == (10, 4, 2)
    assert tokens({}) == (0, 0, 0)
    prices = parse_prices('{"m": {"prompt": 1.0, "cached": 0.5, "completion": 2.0}}')
    log = [
        events.with_id(events.LlmResponse(model="m", usage={"prompt_tokens": 1_000_000, "completion_tokens": 0}), 1),
        events.with_id(
            events.LlmResponse(
                model="m",
                usage={
                    "prompt_tokens": 1_000_000,
                    "completion_tokens": 1_000_000,
                    "prompt_tokens_details": {"cached_tokens": 1_000_000},
                },
            ),
            2,
        ),
    ]
    report = usage(log, prices)
    assert [s.cost for s in report.steps] == [1.0, 2.5]
    assert (report.prompt_tokens, report.cached_tokens, report.completion_tokens, report.cost) == (
        2_000_000,
        1_000_000,
        1_000_000,
        3.5,
    )
    assert usage(log, {}).cost is None
    with pytest.raises(ConfigError, match="RIVERBED_PRICES"):
        parse_prices('{"m": {"prompt": "cheap"}}')


async def test_riverbed_usage_over_a_recorded_run(
    bus: Bus, server: OpenAIServer, workers: None, workspace: Path, cli_env: dict[str, str]
) -> None:
    from tests.kit.cli import ok  # noqa: PLC0415

    seed_workspace(workspace, "usage-1")
    server.reply(tool_calls=[("cmd_run", {"command": "echo one"})])
    server.reply(tool_calls=[("cmd_run", {"command": "echo two"})])
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    await run_llm_agent(bus, "usage-1", "Say one, two.", settings=SETTINGS, client=server.client(), max_steps=5)
    log = await bus.session("usage-1").events()
    responses = [e for e in log if isinstance(e, events.LlmResponse)]
    # The agent records the provider's usage as sent, cached prompt tokens included.
    assert [r.usage["prompt_tokens_details"]["cached_tokens"] > 0 for r in responses] == [False, True, True]

    env = {**cli_env, "RIVERBED_PRICES": '{"test-model": {"prompt": 1.0, "cached": 0.1, "completion": 2.0}}'}
    document = json.loads(ok(env, "usage", "usage-1", "--json"))
    steps = document["steps"]
    assert [s["event_id"] for s in steps] == [r.id for r in responses]
    for step, response in zip(steps, responses, strict=True):
        assert step["prompt_tokens"] == response.usage["prompt_tokens"]
        assert step["cached_tokens"] == response.usage["prompt_tokens_details"]["cached_tokens"]
        assert step["completion_tokens"] == response.usage["completion_tokens"]
        uncached = step["prompt_tokens"] - step["cached_tokens"]
        assert step["cost"] == pytest.approx(
            (uncached * 1.0 + step["cached_tokens"] * 0.1 + step["completion_tokens"] * 2.0) / 1e6
        )
    assert document["cached_tokens"] == sum(s["cached_tokens"] for s in steps) > 0
    assert document["cost"] == pytest.approx(sum(s["cost"] for s in steps))
    table = ok(env, "usage", "usage-1").decode()
    assert "total" in table
    assert "3 calls" in table

"""Users' agents hosted by the agent role: Python tools called as ``tool_call`` actions and
answered once by ``tool_result``, bad arguments answered without running, errors the model
reads, runs on an agent's definition (name, digest, rules) and stuck runs."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import riverbed
from riverbed import events
from riverbed.agent.define import REFERENCE
from riverbed.agent.hosted import RunLimits, list_runs, open_run, upgrade_run
from riverbed.agent.registry import Hosted, load, publish_fields
from riverbed.client.session import Bus
from riverbed.errors import ConfigError, InputError
from riverbed.settings import Settings
from riverbed.workers.agent_run import run_llm_agent
from tests.kit.agent_role import ended, roles, server  # noqa: F401  (fixtures)
from tests.kit.agents import runtime_worker
from tests.kit.cli import assert_one_sentence, ok, run
from tests.kit.openai_server import OpenAIServer, tool_call
from tests.kit.user_agents import handy, lead, scribe

pytestmark = pytest.mark.anyio

HOSTED = load(["tests.kit.user_agents"], entry_point_group=None)
"""The reference agent, scribe and lead."""


@pytest.fixture
def journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "journal.txt"
    monkeypatch.setenv("RIVERBED_TEST_JOURNAL", str(path))
    return path


async def test_a_user_tool_runs_once_per_call_and_the_model_reads_its_result(
    bus: Bus, workspace: Path, server: OpenAIServer, journal: Path
) -> None:
    server.reply(tool_calls=[("note", {"entry": "first"}), ("add", {"a": 2, "b": 3})])
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    async with roles(bus, workspace, server, hosted=HOSTED):
        opened = await open_run(bus, "u1", "keep notes", agent=scribe, limits=RunLimits(max_steps=5))
        seen = await ended(bus, "u1", opened.task)
    kinds = [e.kind for e in seen]
    assert kinds == [
        "message",
        "run_started",
        "llm_response",
        "tool_call",
        "tool_result",
        "tool_call",
        "tool_result",
        "llm_response",
        "finish",
    ]
    started = seen[1]
    assert isinstance(started, events.RunStarted)
    assert (started.agent_name, started.digest) == ("scribe", scribe.digest)
    calls = [e for e in seen if isinstance(e, events.ToolCall)]
    results = [e for e in seen if isinstance(e, events.ToolResult)]
    assert [(c.tool, c.arguments) for c in calls] == [("note", {"entry": "first"}), ("add", {"a": 2, "b": 3})]
    assert [r.cause for r in results] == [c.id for c in calls]
    assert [r.content for r in results] == ["noted first", '{"sum":5}']
    assert journal.read_text() == f"u1:{calls[0].id} first\n"
    # The model was offered the agent's tools (and finish), with the system prompt its instructions.
    request = server.requests[0]
    offered = [t["function"]["name"] for t in request["tools"]]
    assert offered == ["think", "note", "note_again", "add", "refuse", "crash", "linger", "finish"]
    assert request["messages"][0] == {"role": "system", "content": "You keep a journal of what you are told."}
    add_schema = next(t for t in request["tools"] if t["function"]["name"] == "add")["function"]["parameters"]
    assert add_schema["properties"]["a"] == {"type": "integer", "minimum": 0, "maximum": 100}
    # The second prompt pairs each call with its result by the call's id.
    second = server.requests[1]["messages"]
    tool_messages = [m for m in second if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == ["noted first", '{"sum":5}']


async def test_bad_arguments_errors_and_overruns_reach_the_model_and_nothing_bad_runs(
    bus: Bus, workspace: Path, server: OpenAIServer, journal: Path
) -> None:
    server.reply(tool_calls=[("add", {"a": 500})])  # out of the schema's bounds
    server.reply(tool_calls=[("note", {"entry": 7})])  # wrong type
    server.reply(tool_calls=[("refuse", {"reason": "no"}), ("crash", {}), ("linger", {"seconds": 3})])
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    async with roles(bus, workspace, server, hosted=HOSTED):
        opened = await open_run(bus, "u2", "try things", agent=scribe, limits=RunLimits(max_steps=6))
        seen = await ended(bus, "u2", opened.task)
    assert not journal.exists()  # the badly typed note never ran
    rejects = [e for e in seen if isinstance(e, events.Error) and e.reason == "bad_tool_call"]
    assert len(rejects) == 2
    assert "bad arguments for add" in rejects[0].content
    assert "bad arguments for note" in rejects[1].content
    results = [e for e in seen if isinstance(e, events.ToolResult)]
    assert [r.is_error for r in results] == [True, True, True]
    assert results[0].content == "refused: no"
    assert results[1].content == "the tool crash raised ValueError: the disk is on fire"
    assert results[2].content == "the tool linger did not finish within 0.5 s"
    assert seen[-1].kind == "finish"


async def test_a_run_that_repeats_itself_ends_stuck(
    bus: Bus, workspace: Path, server: OpenAIServer, journal: Path
) -> None:
    for _ in range(4):
        server.reply(tool_calls=[("add", {"a": 1, "b": 1})])
    async with roles(bus, workspace, server, hosted=HOSTED):
        opened = await open_run(bus, "u3", "loop", agent=scribe, limits=RunLimits(max_steps=10))
        seen = await ended(bus, "u3", opened.task)
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert last.reason == "stuck"
    assert "same call with the same result 3 times" in last.content
    assert len(server.requests) == 3


async def test_an_unknown_agent_is_refused_naming_the_known_ones(bus: Bus) -> None:
    with pytest.raises(InputError, match=r"there is no agent 'nobody'; the agents this deployment knows are llm"):
        await open_run(bus, "u4", "task", agent="nobody")


def test_definitions_are_checked_in_one_sentence() -> None:
    with pytest.raises(InputError, match="there is no built-in tool 'shell'"):
        riverbed.Agent("a", tools=["shell"])

    def cmd_run(command: str) -> str:
        return command

    shadowing = riverbed.tool(cmd_run)
    with pytest.raises(InputError, match="has the name of a built-in tool"):
        riverbed.Agent("a", tools=[shadowing])

    def untyped(x) -> str:  # type: ignore[no-untyped-def]
        return str(x)

    with pytest.raises(InputError, match="has no type annotation"):
        riverbed.tool(untyped)

    with pytest.raises(InputError, match="an agent's name"):
        riverbed.Agent("no spaces please")


async def test_a_run_on_another_definition_waits_until_upgraded(
    bus: Bus, workspace: Path, server: OpenAIServer, journal: Path
) -> None:
    # The run opens on scribe as defined now; the worker hosts a changed scribe (a rolling deploy).
    changed = riverbed.Agent("scribe", "You keep a terse journal.", tools=scribe.tools, stuck=scribe.stuck)
    assert changed.digest != scribe.digest
    new_deployment = Hosted({"scribe": changed, "llm": REFERENCE}, {"scribe": "tests", "llm": "riverbed"})
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    async with roles(bus, workspace, server, hosted=new_deployment):
        opened = await open_run(bus, "v1", "keep notes", agent=scribe, limits=RunLimits(max_steps=3))
        # Nothing is asked of the model; `riverbed runs` says what the run waits for.
        with anyio.fail_after(20):
            while True:
                (row,) = await list_runs(bus)
                if scribe.digest in row.detail:
                    break
                await anyio.sleep(0.05)
        assert row.worker is None
        assert "waiting for a worker that hosts agent 'scribe'" in row.detail
        await anyio.sleep(0.5)
        assert server.requests == []
        # The operator moves the run to the new definition: the switch is on the log.
        async with bus.client.pipeline() as pipe:
            pipe.hset(bus.keys.agents, mapping=publish_fields(new_deployment, "w-new"))
            await pipe.execute()
        upgrade = await upgrade_run(bus, "v1")
        seen = await ended(bus, "v1", opened.task)
    switched = next(e for e in seen if e.id == upgrade)
    assert isinstance(switched, events.RunUpgraded)
    assert (switched.previous, switched.digest) == (scribe.digest, changed.digest)
    assert seen[-1].kind == "finish"
    assert server.requests[0]["messages"][0]["content"] == "You keep a terse journal."


def test_the_cli_refuses_an_unknown_agent_and_lists_the_known_ones(cli_env: dict[str, str]) -> None:
    result = run(
        {**cli_env, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}, "agent", "c1", "do it", "--agent", "nobody", "--detach"
    )
    assert_one_sentence(result, 2, "there is no agent 'nobody'", "llm")
    assert ok(cli_env, "agents", "--json") == b""  # no worker published any yet


async def test_an_action_no_role_answers_is_answered_timeout_and_the_run_goes_on(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    # No memory worker runs: the recall is never answered, so the agent answers it at its deadline.
    server.reply(tool_calls=[("recall", {"query": "the config"})])
    server.reply(tool_calls=[("finish", {"final_thought": "gave up on memory"})])
    async with roles(bus, workspace, server, action_timeout=1.0):
        opened = await open_run(bus, "t1", "remember", limits=RunLimits(max_steps=3))
        seen = await ended(bus, "t1", opened.task)
    (recall,) = [e for e in seen if isinstance(e, events.Recall)]
    (timeout,) = [e for e in seen if isinstance(e, events.Error) and e.cause == recall.id]
    assert (timeout.reason, timeout.retryable, timeout.source) == ("timeout", True, "agent")
    assert "no answer to recall" in timeout.content
    assert seen[-1].kind == "finish"


async def test_a_sub_agent_by_name_runs_its_own_definition(
    bus: Bus, workspace: Path, server: OpenAIServer, journal: Path
) -> None:
    def script(request: dict[str, object]) -> dict[str, object]:
        messages = request["messages"]
        assert isinstance(messages, list)
        system, last = messages[0]["content"], messages[-1]
        if system.startswith("You lead"):
            if last["role"] == "tool":
                return {"tool_calls": [tool_call("finish", {"final_thought": f"lead: {last['content']}"})]}
            return {"tool_calls": [tool_call("delegate", {"task": "note 'hello'", "agent": "scribe"})]}
        if last["role"] == "tool":
            return {"tool_calls": [tool_call("finish", {"final_thought": "scribe: noted"})]}
        return {"tool_calls": [tool_call("note", {"entry": "hello"})]}

    server.respond(script, times=10)
    async with roles(bus, workspace, server, hosted=HOSTED):
        opened = await open_run(bus, "lead", "take a note", agent=lead, limits=RunLimits(max_steps=4))
        seen = await ended(bus, "lead", opened.task)
    offered = next(t for t in server.requests[0]["tools"] if t["function"]["name"] == "delegate")
    assert offered["function"]["parameters"]["properties"]["agent"]["enum"] == ["scribe"]
    (delegate,) = [e for e in seen if isinstance(e, events.Delegate)]
    assert delegate.sub_agent == "scribe"
    child = await bus.session(f"lead.sub{delegate.id}").events()
    started = next(e for e in child if isinstance(e, events.RunStarted))
    assert (started.agent_name, started.digest) == ("scribe", scribe.digest)
    assert [e.kind for e in child if e.kind.startswith("tool")] == ["tool_call", "tool_result"]
    assert journal.read_text().endswith(" hello\n")
    assert seen[-1].kind == "finish"
    assert "scribe: noted" in seen[-1].final_thought


async def test_the_in_process_loop_and_the_role_write_the_same_log(
    bus: Bus, workspace: Path, server: OpenAIServer, journal: Path
) -> None:
    def script() -> None:
        server.reply("Looking.", tool_calls=[("cmd_run", {"command": "echo one"}), ("note", {"entry": "one"})])
        server.reply("Almost.")  # a text-only answer: the run's final word
        server.reply(tool_calls=[("finish", {"final_thought": "never asked"})])

    def shape(log: list[events.Event]) -> list[tuple[str, str, bool]]:
        return [(e.kind, e.source, isinstance(e, events.Action) and isinstance(e.tool_call_id, str)) for e in log]

    settings = Settings(llm_model="test-model", agent_context_recalls="off", agent_llm_retry_seconds=0)
    script()
    async with runtime_worker(bus, workspace):
        ended_in_process = await run_llm_agent(
            bus, "same-1", "do it", settings=settings, client=server.client(), agent=handy, max_steps=5
        )
    server.clear()
    script()
    async with roles(bus, workspace, server, hosted=HOSTED):
        opened = await open_run(bus, "same-2", "do it", agent=handy, limits=RunLimits(max_steps=5))
        await ended(bus, "same-2", opened.task)
    in_process = await bus.session("same-1").events()
    in_role = await bus.session("same-2").events()
    assert shape(in_process) == shape(in_role)
    assert [e.kind for e in in_role] == [
        "message",
        "run_started",
        "llm_response",
        "cmd_run",
        "cmd_output",
        "tool_call",
        "tool_result",
        "llm_response",
        "finish",
    ]
    assert isinstance(ended_in_process, events.Finish)
    assert ended_in_process.final_thought == "Almost."


async def test_oversized_model_output_is_bounded_and_the_run_goes_on(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    # 10,000 tool calls in one response, then one call with 20 MB of arguments.
    server.reply(tool_calls=[("think", {"thought": f"{i}"}) for i in range(10_000)])
    server.reply(tool_calls=[("cmd_run", {"command": "echo " + "x" * 20_000_000})])
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    async with roles(bus, workspace, server):
        opened = await open_run(bus, "big", "flood", limits=RunLimits(max_steps=5))
        seen = await ended(bus, "big", opened.task, timeout=60)
    assert seen[-1].kind == "finish"
    rejects = [e for e in seen if isinstance(e, events.Error) and e.reason == "bad_tool_call"]
    assert len(rejects) == 2
    assert "made 10000 tool calls; at most 32 are run per response" in rejects[0].content
    assert "the arguments were 20,000," in rejects[1].content
    assert not any(isinstance(e, events.Think | events.CmdRun) for e in seen)  # none of those calls ran
    sizes = [len(events.encode(e)) for e in await bus.session("big").events()]
    assert max(sizes) < 4 * 1024 * 1024
    # The model read both errors.
    assert "at most 32" in server.requests[1]["messages"][-1]["content"]
    assert "20,000," in server.requests[2]["messages"][-1]["content"]


def test_an_installed_packages_entry_point_registers_its_agents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = tmp_path / "acme_agents-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-agents\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[riverbed.agents]\nscribe = tests.kit.user_agents:scribe\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hosted = load()
    assert hosted.get("scribe") is scribe
    assert hosted.where["scribe"] == "entry point scribe (tests.kit.user_agents:scribe)"
    (dist / "entry_points.txt").write_text("[riverbed.agents]\nbroken = tests.kit.nowhere:agents\n")
    with pytest.raises(ConfigError, match=r"the entry point 'broken' of riverbed\.agents does not load"):
        load()
    with pytest.raises(ConfigError, match=r"the agents module 'tests\.kit\.nowhere' does not import"):
        load(["tests.kit.nowhere"], entry_point_group=None)

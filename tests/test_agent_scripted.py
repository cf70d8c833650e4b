"""The scripted agent: script validation, a transcript against a real runtime worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from riverbed import events
from riverbed.agent.scripted import load_script, parse_script, run_script, run_scripted_agent
from riverbed.client.session import Bus
from riverbed.errors import ActTimeout, InputError
from tests.kit.agents import runtime_worker

pytestmark = pytest.mark.anyio

SCRIPTS = Path(__file__).with_name("scripts")


def test_a_script_is_parsed_into_actions() -> None:
    actions = load_script(SCRIPTS / "hello.jsonl")
    assert [a.kind for a in actions] == [
        "message",
        "think",
        "file_write",
        "cmd_run",
        "file_edit",
        "file_read",
        "python_run",
        "finish",
    ]
    first = actions[0]
    assert isinstance(first, events.Message)
    assert first.source == "user"
    explicit = parse_script(['{"kind": "message", "content": "hi", "source": "agent"}'])
    assert explicit[0].source == "agent"


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        (['{"kind": "cmd_run", "command": "ls"}', "not json"], "line 2 is not a JSON object"),
        (["", '{"kind": "teleport"}'], "line 2: unknown event kind 'teleport'"),
        (['{"kind": "cmd_output", "content": "x"}'], "line 1: 'cmd_output' is not an action kind"),
        (['{"command": "ls"}'], "line 1: an event needs a string 'kind' field"),
        (['{"kind": "cmd_run"}'], "line 1: invalid cmd_run event"),
        (['{"kind": "file_read", "path": "x", "id": 3}'], "line 1: an action in a script cannot set 'id'"),
        (["[1, 2]"], "line 1 is not a JSON object"),
    ],
)
def test_bad_lines_are_named(lines: list[str], pattern: str) -> None:
    with pytest.raises(InputError, match=pattern):
        parse_script(lines, name="s.jsonl")


def test_a_missing_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read the script"):
        load_script(tmp_path / "nope.jsonl")
    (tmp_path / "latin.jsonl").write_bytes(b'{"kind": "think", "thought": "\xe9"}')
    with pytest.raises(InputError, match="not UTF-8"):
        load_script(tmp_path / "latin.jsonl")


async def test_a_bad_script_appends_nothing(bus: Bus) -> None:
    with pytest.raises(InputError, match=r"bad\.jsonl line 3: invalid cmd_run event"):
        await run_scripted_agent(bus, "bad", SCRIPTS / "bad.jsonl")
    assert not await bus.log_store.exists("bad")


async def test_the_hello_script_runs_against_a_real_runtime(bus: Bus, workspace: Path) -> None:
    async with runtime_worker(bus, workspace) as runtime:
        steps = await run_scripted_agent(bus, "hello", SCRIPTS / "hello.jsonl", timeout=20)
        ws = runtime.workspace("hello")
        assert (ws / "hello.py").read_text() == "print('greetings from riverbed')\n"
    transcript = [(s.action.kind, None if s.observation is None else s.observation.kind) for s in steps]
    assert transcript == [
        ("message", None),
        ("think", None),
        ("file_write", "file_written"),
        ("cmd_run", "cmd_output"),
        ("file_edit", "file_edited"),
        ("file_read", "file_content"),
        ("python_run", "python_output"),
        ("finish", None),
    ]
    run = steps[3].observation
    assert isinstance(run, events.CmdOutput)
    assert run.content.strip() == "hello from riverbed"
    cell = steps[6].observation
    assert isinstance(cell, events.PythonOutput)
    assert cell.result == "42"
    for step in steps:
        assert step.action.agent == "scripted"
        if step.observation is not None:
            assert step.observation.cause == step.action.id
    log = await bus.session("hello").events()
    assert log[0].source == "user"
    assert len(log) == 13


async def test_a_missing_answer_times_out_per_action(bus: Bus) -> None:
    session = bus.session("nobody-home")
    seen: list[str] = []

    async def drive() -> None:
        script = [events.Think(thought="x"), events.CmdRun(command="ls")]
        seen.extend([step.action.kind async for step in run_script(session, script, timeout=0.3)])

    with pytest.raises(ActTimeout):
        await drive()
    assert seen == []
    assert [e.kind for e in await session.events()] == ["think", "cmd_run"]

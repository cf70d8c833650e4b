"""Condensation by conversation: ``riverbed context SESSION suggest "..." [--apply]``.

The proposal's checks are pure (no services); the command runs against the scripted
OpenAI-compatible server, which answers the suggest prompt deterministically: it forgets
every event of the context that mentions the word in the request."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from msgspec.structs import replace

import riverbed
from riverbed import events
from riverbed.errors import InputError
from riverbed.memory.suggest import parse_proposal, proposal_messages
from riverbed.memory.view import view
from tests.kit.cli import assert_one_sentence, run
from tests.kit.openai_server import OpenAIServer, server  # noqa: F401  (server: a fixture)


def _log() -> list[events.Event]:
    raw: list[events.Event] = [
        events.Message(source="user", content="build the app"),
        events.CmdRun(source="agent", command="docker ps"),
        events.CmdOutput(source="runtime", cause=2, content="docker: command not found", exit_code=127),
        events.CmdRun(source="agent", command="docker info"),
        events.CmdOutput(source="runtime", cause=4, content="docker: command not found", exit_code=127),
        events.Think(source="agent", thought="no docker here; we decided to build with make"),
        events.CmdRun(source="agent", command="make"),
        events.CmdOutput(source="runtime", cause=7, content="ok", exit_code=0),
    ]
    return [events.with_id(e, i) for i, e in enumerate(raw, 1)]


def about(word: str) -> Any:
    """A responder: forget every context line that mentions ``word``, summarise them."""

    def answer(request: dict[str, Any]) -> dict[str, Any]:
        context = request["messages"][-1]["content"]
        ids = [int(m.group(1)) for m in re.finditer(r"^\[(\d+)\] (?:cmd_run|cmd_output).*$", context, re.M)
               if word in m.group(0)]  # fmt: skip
        return {"content": json.dumps({"forget": [[i, i] for i in ids], "summary": f"{word} is not available"})}

    return answer


# --- pure ----------------------------------------------------------------------------------


def test_the_prompt_shows_the_context_with_ids_pins_and_the_request() -> None:
    log = [*_log(), events.with_id(events.ContextEdit(op="pin", ranges=[(6, 6)]), 9)]
    messages = proposal_messages(log, "drop the docker detour")
    text = messages[-1]["content"]
    assert "[2] cmd_run (agent): docker ps" in text
    assert "[6] think (agent) [pinned]" in text
    assert "<request>\ndrop the docker detour\n</request>" in text
    assert '"forget"' in messages[0]["content"]


def test_a_valid_proposal_becomes_a_user_condensation_hiding_whole_units() -> None:
    log = _log()
    proposal = parse_proposal('```json\n{"forget": [[2, 2], [4, 5]], "summary": "no docker"}\n```', log, model="m")
    assert proposal.condensation.source == "user"
    assert proposal.condensation.forgotten == [(2, 2), (4, 5)]
    assert proposal.change.hidden == (2, 3, 4, 5)  # 3 goes with its call 2
    after = view([*log, events.with_id(proposal.condensation, 9)])
    assert after.ids() == [1, 6, 7, 8]
    assert after.summary is not None
    assert after.summary.content == "no docker"
    assert [e.id for e in proposal.after.view.real_events()] == [1, 6, 7, 8]


@pytest.mark.parametrize(
    ("answer", "fragment"),
    [
        ("sure, drop 2-5", "not JSON"),
        ('{"drop": [[2, 5]]}', 'no "forget" list'),
        ('{"forget": [[5, 2]]}', "not within events 1-8"),
        ('{"forget": [[2, 99]]}', "not within events 1-8"),
        ('{"forget": [["2", 5]]}', "not a range"),
        ('{"forget": [[2, 3]], "summary": 7}', "summary is not text"),
        ('{"forget": []}', "forget nothing"),
    ],
)
def test_an_invalid_proposal_is_refused_in_one_sentence(answer: str, fragment: str) -> None:
    with pytest.raises(InputError, match=re.escape(fragment)):
        parse_proposal(answer, _log())


def test_a_proposal_that_only_touches_pinned_events_hides_nothing_and_is_refused() -> None:
    log = [*_log(), events.with_id(events.ContextEdit(op="pin", ranges=[(6, 6)]), 9)]
    with pytest.raises(InputError, match="hides nothing"):
        parse_proposal('{"forget": [[6, 6]], "summary": null}', log)


# --- the command ---------------------------------------------------------------------------


@pytest.fixture
def env(cli_env: dict[str, str], server: OpenAIServer) -> dict[str, str]:
    out = {k: v for k, v in cli_env.items() if not k.startswith("OPENAI_")}
    out.update(OPENAI_BASE_URL=server.base_url, OPENAI_API_KEY="k", RIVERBED_LLM_MODEL="big", COLUMNS="200")
    return out


pytestmark = pytest.mark.anyio


async def test_suggest_prints_a_diff_and_changes_nothing_until_apply(
    env: dict[str, str], server: OpenAIServer, redis_url: str, prefix: str
) -> None:
    async with riverbed.connect(redis_url, prefix=prefix) as bus:
        session = bus.session("sg")
        await session.append(*[replace(e, id=None) for e in _log()])
        server.respond(about("docker"))
        dry = run({**env, "RIVERBED_SUGGEST_MODEL": "cheap"}, "context", "sg", "suggest", "drop", "the", "docker")
        assert dry.returncode == 0, dry.stderr.decode()
        lines = dry.stdout.decode().splitlines()
        assert [line.split()[1] for line in lines if line.startswith("- ")] == ["2", "3", "4", "5"]
        assert any(line.startswith("  ") and " make" in line for line in lines)
        assert "+ summary: docker is not available" in lines[-1]
        assert "cheap proposes to forget 2-2, 3-3, 4-4, 5-5, which hides 4 events (2-5)" in dry.stderr.decode()
        assert "nothing was changed" in dry.stderr.decode()
        assert server.requests[-1]["model"] == "cheap"
        assert "drop the docker" in server.requests[-1]["messages"][-1]["content"]
        assert await session.last_id() == 8

        server.respond(about("docker"))
        applied = run(env, "context", "sg", "suggest", "drop the docker detour", "--apply", "--model", "m2")
        assert applied.returncode == 0, applied.stderr.decode()
        assert "applied as condensation 9: hid 4 events (2-5)" in applied.stderr.decode()
        assert server.requests[-1]["model"] == "m2"
        log = await session.events()
        assert isinstance(log[-1], events.Condensation)
        assert log[-1].source == "user"
        now = view(log)
        assert now.ids() == [1, 6, 7, 8]
        assert now.summary is not None
        assert now.summary.content == "docker is not available"


async def test_an_invalid_proposal_or_no_model_is_one_sentence(
    env: dict[str, str], offline_env: dict[str, str], server: OpenAIServer, redis_url: str, prefix: str
) -> None:
    async with riverbed.connect(redis_url, prefix=prefix) as bus:
        session = bus.session("sg2")
        await session.append(events.Message(source="user", content="hi"))
        server.reply('{"forget": [[1, 40]]}')
        assert_one_sentence(run(env, "context", "sg2", "suggest", "drop all", "--apply"), 2, "not within events 1-1")
        assert await session.last_id() == 1
    no_model = {k: v for k, v in offline_env.items() if not k.startswith("OPENAI_")}
    assert_one_sentence(run(no_model, "context", "sg2", "suggest", "x"), 2, "OPENAI_API_KEY")

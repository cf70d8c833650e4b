"""Users' Python tools under faults, with real agent worker processes hosting
``tests.kit.user_agents`` and the scripted model server: a tool runs exactly once per recorded
call across a SIGKILL of its worker.

- killed after the call was recorded but before it was claimed: the peer runs it, once;
- killed after a non-idempotent tool ran, before its result was appended: the peer answers
  ``tool_lost`` (retryable) and never runs it again;
- killed likewise on an idempotent tool: the peer runs it again, with the same idempotency key.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, follow_run, open_run
from riverbed.client.session import Bus
from tests.kit.agent_faults import (  # noqa: F401  (fixtures)
    model_env,
    ready,
    spawn,
    start,
    wait_until,
    workers,
)
from tests.kit.openai_server import OpenAIServer
from tests.kit.workers import WorkerProcess

pytestmark = [pytest.mark.anyio, pytest.mark.fault]


@pytest.fixture
def server() -> object:
    with OpenAIServer(model="test-model") as server:
        yield server


async def _run_through_a_kill(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, journal: Path, tool: str, crash_at: str
) -> list[events.Event]:
    server.reply(tool_calls=[(tool, {"entry": "once"})])
    server.reply(tool_calls=[("finish", {"final_thought": "noted"})])
    env = {"RIVERBED_AGENTS": "tests.kit.user_agents", "RIVERBED_TEST_JOURNAL": str(journal)}
    doomed = start("a1", ["agent"], RIVERBED_CRASH_AT=crash_at, **env)
    await ready(doomed)
    opened = await open_run(bus, "tools", "task", agent="scribe", limits=RunLimits(max_steps=4))
    await wait_until(lambda: doomed.proc.poll() is not None, 60, f"the worker did not reach {crash_at}")
    assert doomed.proc.returncode == -signal.SIGKILL
    peer = start("a2", ["agent"], **env)
    await ready(peer)
    seen = [e async for e in follow_run(bus, "tools", opened.task)]
    assert isinstance(seen[-1], events.Finish), seen
    return seen


def _answers(seen: list[events.Event]) -> tuple[events.ToolCall, list[events.Event]]:
    (call,) = [e for e in seen if isinstance(e, events.ToolCall)]
    return call, [e for e in seen if isinstance(e, events.Observation) and e.cause == call.id]


async def test_a_call_recorded_but_never_claimed_runs_once_on_the_peer(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.txt"
    seen = await _run_through_a_kill(bus, start, server, journal, "note", "agent_after_response:1")
    call, answers = _answers(seen)
    assert [type(a) for a in answers] == [events.ToolResult]
    assert journal.read_text().splitlines() == [f"tools:{call.id} once"]


async def test_a_non_idempotent_call_that_ran_on_a_killed_worker_is_answered_tool_lost(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.txt"
    seen = await _run_through_a_kill(bus, start, server, journal, "note", "agent_tool_ran:1")
    call, answers = _answers(seen)
    (lost,) = answers
    assert isinstance(lost, events.Error)
    assert (lost.reason, lost.retryable) == ("tool_lost", True)
    assert journal.read_text().splitlines() == [f"tools:{call.id} once"]  # it ran once, and never again
    # The model read the loss.
    assert any("was lost" in m.get("content", "") for m in server.requests[-1]["messages"] if m["role"] == "tool")


async def test_an_idempotent_call_that_ran_on_a_killed_worker_runs_again_with_the_same_key(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.txt"
    seen = await _run_through_a_kill(bus, start, server, journal, "note_again", "agent_tool_ran:1")
    call, answers = _answers(seen)
    assert [type(a) for a in answers] == [events.ToolResult]
    assert journal.read_text().splitlines() == [f"tools:{call.id} once"] * 2

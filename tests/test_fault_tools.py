"""Users' Python tools under faults, with real agent worker processes hosting
``tests.kit.user_agents`` and the scripted model server: a tool runs exactly once per recorded
call across a SIGKILL of its worker.

- killed after the call was recorded but before it was claimed: the peer runs it, once;
- killed after a non-idempotent tool ran, before its result was appended: the peer answers
  ``tool_lost`` (retryable) and never runs it again;
- killed likewise on an idempotent tool: the peer runs it again, with the same idempotency key.

And a worker process hosting the module publishes its agents (``riverbed agents --json``), so a
run opened by name from the CLI records the digest the worker hosts.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, decide, follow_run, list_runs, open_run
from riverbed.client.session import Bus
from riverbed.runtime.paths import workspace_name
from tests.kit.agent_faults import (  # noqa: F401  (fixtures)
    model_env,
    ready,
    spawn,
    start,
    wait_until,
    workers,
)
from tests.kit.cli import ok, run
from tests.kit.openai_server import OpenAIServer
from tests.kit.patience import within
from tests.kit.user_agents import scribe
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


async def test_workers_publish_the_agents_they_host_and_runs_open_on_them_by_name(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, cli_env: dict[str, str], tmp_path: Path
) -> None:
    host = start("a1", ["agent"], RIVERBED_AGENTS="tests.kit.user_agents")
    await ready(host)
    listed = [json.loads(line) for line in ok(cli_env, "agents", "--json").splitlines()]
    by_name = {row["name"]: row for row in listed}
    assert set(by_name) == {"llm", "scribe", "lead", "handy"}
    assert by_name["scribe"]["digest"] == scribe.digest
    assert by_name["scribe"]["live"] is True
    assert by_name["scribe"]["where"] == "tests.kit.user_agents"
    assert by_name["lead"]["sub_agents"] == ["scribe"]
    # A run opened by name (the CLI's way) records the digest the worker published.
    server.reply(tool_calls=[("finish", {"final_thought": "done"})])
    result = run(cli_env, "agent", "by-name", "note nothing", "--agent", "scribe", "--detach")
    assert result.returncode == 0, result.stderr.decode()
    seen = [e async for e in follow_run(bus, "by-name", 1)]
    started = next(e for e in seen if isinstance(e, events.RunStarted))
    assert (started.agent_name, started.digest) == ("scribe", scribe.digest)
    assert seen[-1].kind == "finish"


async def test_a_call_waiting_for_approval_survives_its_workers_death(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, workspace: Path
) -> None:
    server.reply(tool_calls=[("cmd_run", {"command": "rm -rf cache && echo cleaned > done.txt"})])
    server.reply(tool_calls=[("finish", {"final_thought": "cleaned"})])
    runtime, doomed = start("r1", ["runtime"]), start("a1", ["agent"])
    await ready(runtime, doomed)
    opened = await open_run(bus, "wait", "clean", limits=RunLimits(max_steps=3), confirm="risky")
    with anyio.fail_after(within(30)):
        while not any(r.awaiting for r in await list_runs(bus) if r.session == "wait"):
            await anyio.sleep(0.05)
    doomed.kill()
    runtime.kill()
    assert not (workspace / workspace_name("wait") / "done.txt").exists()
    peer, runtime2 = start("a2", ["agent"]), start("r2", ["runtime"])
    await ready(peer, runtime2)
    _, decided = await decide(bus, "wait", by="ops")
    seen = [e async for e in follow_run(bus, "wait", opened.task)]
    assert seen[-1].kind == "finish", seen[-1]
    (output,) = [e for e in seen if isinstance(e, events.CmdOutput)]
    assert output.cause == decided[0]
    assert (workspace / workspace_name("wait") / "done.txt").read_text() == "cleaned\n"
    assert len(server.requests) == 2  # no model call was repeated

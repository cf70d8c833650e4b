"""Sub-agent tests' shared parts: the scripted model read from each task, agent worker processes, checks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import follow_run
from riverbed.agent.runs import child_session
from riverbed.client.session import Bus
from tests.kit.agent_faults import LEASE, model_env, start, workers  # noqa: F401  (fixtures)
from tests.kit.openai_server import OpenAIServer
from tests.kit.patience import within
from tests.kit.workers import ready, spawn  # noqa: F401  (spawn: a fixture)

# --- the scripted model: what each session's agent does, read from its task -------------------


def task_of(request: dict[str, Any]) -> str:
    for message in request.get("messages", []):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            return str(message["content"])
    raise AssertionError(f"no task in {request}")


def step_of(request: dict[str, Any]) -> int:
    return sum(1 for m in request.get("messages", []) if m.get("role") == "assistant" and m.get("tool_calls"))


def results_of(request: dict[str, Any]) -> list[str]:
    """The tool results of the request's last step."""
    out: list[str] = []
    for message in reversed(request.get("messages", [])):
        if message.get("role") != "tool":
            break
        out.insert(0, str(message.get("content")).splitlines()[0])
    return out


def call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def finish(text: str, call_id: str) -> dict[str, Any]:
    return {"tool_calls": [call("finish", {"final_thought": text}, call_id)]}


def script(request: dict[str, Any]) -> dict[str, Any]:
    """``split NAME K``: delegate K leaves at once, then finish with their results.
    ``leaf NAME``: one command, then finish.  ``nest NAME D``: delegate ``nest NAME D+1``, then
    finish with what came back.  ``wait NAME``: delegate ``sleeper NAME``, which runs a long command."""
    task, step = task_of(request), step_of(request)
    verb, name, *rest = task.split()
    key = f"{name}-{step}"
    if verb == "split":
        if step == 0:
            count = int(rest[0])
            return {"tool_calls": [call("delegate", {"task": f"leaf {name}.{i}"}, f"{key}-{i}") for i in range(count)]}
        return finish(" | ".join(results_of(request)), key)
    if verb == "leaf":
        if step == 0:
            return {"tool_calls": [call("cmd_run", {"command": f"echo {name} >> ran.txt"}, key)]}
        return finish(f"{name} done", key)
    if verb == "nest":
        if step == 0:
            return {"tool_calls": [call("delegate", {"task": f"nest {name} {int(rest[0]) + 1}"}, key)]}
        return finish(f"level {rest[0]} got: {results_of(request)[0]}", key)
    if verb == "wait":
        if step == 0:
            return {"tool_calls": [call("delegate", {"task": f"sleeper {name}.{i}"}, f"{key}-{i}") for i in range(2)]}
        return finish("woke", key)
    if verb == "sleeper":
        if step == 0:
            return {"tool_calls": [call("delegate", {"task": f"leafsleep {name}"}, key)]}
        return finish("slept", key)
    if verb == "leafsleep":
        return {"tool_calls": [call("cmd_run", {"command": "sleep 60", "blocking": True, "timeout": 120}, key)]}
    raise AssertionError(f"unscripted task {task!r}")


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer(model="test-model") as server:
        server.respond(script, times=10_000)
        yield server


async def run_end(bus: Bus, session: str, timeout: float = 60.0) -> events.Event:
    """The event that ended the session's (first) run."""
    with anyio.fail_after(within(timeout)):
        async for event in follow_run(bus, session, 1):
            last = event
    return last


async def answers(bus: Bus, session: str) -> dict[int, list[events.Event]]:
    """Each ``delegate`` of the session and the events answering it."""
    log = await bus.session(session).events()
    out: dict[int, list[events.Event]] = {e.id: [] for e in log if isinstance(e, events.Delegate) and e.id}
    for event in log:
        if isinstance(event, events.Observation) and event.cause in out:
            out[event.cause].append(event)
    return out


async def all_answered(bus: Bus, session: str, timeout: float = 30.0) -> dict[int, list[events.Event]]:
    """:func:`answers` once every ``delegate`` of the session has one (a child answers its
    parent right after its run ended)."""
    with anyio.fail_after(within(timeout)):
        while True:
            answered = await answers(bus, session)
            if all(answered.values()):
                await anyio.sleep(0.5)  # (an answer twice would show by now)
                return await answers(bus, session)
            await anyio.sleep(0.05)


async def ran_a_command(bus: Bus, session: str) -> bool:
    return any(isinstance(e, events.CmdRun) for e in await bus.session(session).events())


async def check_child(bus: Bus, parent: str, action: int) -> list[events.Event]:
    """The child of ``parent``'s ``delegate`` ``action`` was created once, as the rules say."""
    child = child_session(parent, action)
    log = await bus.session(child).events()
    assert [e.kind for e in log[:3]] == ["delegated", "message", "run_started"], f"{child}: {log[:3]}"
    header = log[0]
    assert isinstance(header, events.Delegated)
    assert (header.parent, header.parent_action) == (parent, action)
    assert sum(isinstance(e, events.Delegated) for e in log) == 1, f"{child} created twice"
    assert sum(isinstance(e, events.RunStarted) for e in log) == 1, f"{child} run opened twice"
    return log


def check_model_calls(server: OpenAIServer, logs: dict[str, list[events.Event]]) -> int:
    """No model call whose response is in a log was asked again; returns how many were
    repeated (each one was in flight when its worker died)."""
    asked: dict[tuple[str, int], list[float]] = {}
    for request, when in zip(server.requests, server.received, strict=True):
        asked.setdefault((task_of(request), step_of(request)), []).append(when)
    repeated = 0
    for session, log in logs.items():
        task = next(e.content for e in log if isinstance(e, events.Message) and e.source == "user")
        responses = [e for e in log if isinstance(e, events.LlmResponse)]
        for step, response in enumerate(responses):
            times = asked.get((task, step), [])
            assert times, f"{session} step {step} never asked"
            assert max(times) <= response.ts.timestamp(), f"{session} step {step} asked again once recorded"
            assert len(times) <= 2, f"{session} step {step} asked {len(times)} times"
            repeated += len(times) - 1
    return repeated

"""Agent runs under faults: the scripted model, agent and runtime worker processes, the checks every run must pass."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, follow_run, open_run
from riverbed.client.session import Bus
from riverbed.runtime.paths import workspace_name
from tests.kit.answers import check_exactly_one_answer
from tests.kit.openai_server import OpenAIServer
from tests.kit.patience import within
from tests.kit.workers import Spawn, WorkerProcess, ready, spawn  # noqa: F401  (fixtures)

LEASE = 1.0
RUNS = 4
STEPS = 3
"""Model calls with tool calls per run; one more call finishes it."""


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer(model="test-model") as server:
        server.respond(script, times=10_000)
        yield server


def session_of(request: dict[str, Any]) -> str:
    for message in request.get("messages", []):
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str) and content.startswith("task for "):
            return content.removeprefix("task for ").strip()
    raise AssertionError(f"no task in {request}")


def step_of(request: dict[str, Any]) -> int:
    """Which step of its run a request is: the model responses with tool calls it holds."""
    return sum(1 for m in request.get("messages", []) if m.get("role") == "assistant" and m.get("tool_calls"))


def script(request: dict[str, Any]) -> dict[str, Any]:
    """Each step runs two commands that leave a line in the workspace; the last one finishes."""
    session, step = session_of(request), step_of(request)
    if step >= STEPS:
        return {"tool_calls": [{"id": f"{session}-{step}-f", "type": "function", "function": {
            "name": "finish", "arguments": json.dumps({"final_thought": f"{session} done"})}}]}  # fmt: skip
    calls = []
    for part in ("a", "b"):
        line = f"{session}-{step}-{part}"
        arguments = json.dumps({"command": f"echo {line} >> ran.txt"})
        calls.append({"id": line, "type": "function", "function": {"name": "cmd_run", "arguments": arguments}})
    return {"tool_calls": calls}


@pytest.fixture
def workers(workspace: Path) -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        with_continue(worker)
        worker.close()


def with_continue(worker: WorkerProcess) -> None:
    if worker.proc.poll() is None:
        os.kill(worker.proc.pid, signal.SIGCONT)


@pytest.fixture
def model_env(server: OpenAIServer) -> dict[str, str]:
    return {
        "OPENAI_BASE_URL": server.base_url,
        "OPENAI_API_KEY": "test-key",
        "RIVERBED_LLM_MODEL": "test-model",
        "RIVERBED_SANDBOX": "process",
        "RIVERBED_AGENT_LLM_RETRY_SECONDS": "5",
    }


@pytest.fixture
def agent_cli_env(cli_env: dict[str, str], model_env: dict[str, str]) -> dict[str, str]:
    """The command's environment with the scripted model's settings."""
    return {**cli_env, **model_env}


@pytest.fixture
def start(spawn: Spawn, model_env: dict[str, str]) -> Callable[..., WorkerProcess]:
    def start(name: str, roles: list[str], **env: str) -> WorkerProcess:
        return spawn(name, roles, lease=LEASE, **{**model_env, **env})

    return start


async def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    with anyio.fail_after(within(timeout)):
        while not condition():
            await anyio.sleep(0.05)
    assert condition(), what


def stopped(worker: WorkerProcess) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    try:
        stat = Path(f"/proc/{worker.proc.pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


async def open_runs(bus: Bus, sessions: list[str]) -> None:
    for session in sessions:
        await open_run(bus, session, f"task for {session}", limits=RunLimits(max_steps=STEPS + 2))


async def all_finished(bus: Bus, sessions: list[str], timeout: float = 90.0) -> None:
    with anyio.fail_after(within(timeout)):
        for session in sessions:
            async for event in follow_run(bus, session, 1):
                last = event
            assert isinstance(last, events.Finish), f"{session} ended with {last}"


async def check_runs(bus: Bus, server: OpenAIServer, sessions: list[str], workspace: Path) -> int:
    """The invariants of every run; returns how many model calls were made twice (each one
    was in flight on a worker that died or froze)."""
    asked: dict[tuple[str, int], list[float]] = {}
    for request, when in zip(server.requests, server.received, strict=True):
        asked.setdefault((session_of(request), step_of(request)), []).append(when)
    repeated = 0
    for session in sessions:
        log = await check_exactly_one_answer(bus, session)
        responses = [e for e in log if isinstance(e, events.LlmResponse)]
        assert len(responses) == STEPS + 1, f"{session}: {len(responses)} responses"
        for step, response in enumerate(responses):
            calls = [c["id"] for c in response.tool_calls]
            actions = [e for e in log if isinstance(e, events.Action) and e.cause == response.id]
            assert [a.tool_call_id for a in actions] == calls, f"{session}: actions of {response.id}"
            times = asked.get((session, step), [])
            # A call whose response is in the log is never made again: every request for this step
            # came before its response was recorded, and one was repeated at most once.
            assert times, f"{session} step {step} never asked"
            assert max(times) <= response.ts.timestamp(), f"{session} step {step} asked again once recorded"
            assert len(times) <= 2, f"{session} step {step} asked {len(times)} times"
            repeated += len(times) - 1
        ran = (workspace / workspace_name(session) / "ran.txt").read_text().split()
        expected = [f"{session}-{step}-{part}" for step in range(STEPS) for part in ("a", "b")]
        assert ran == expected, f"{session}: commands ran {ran}"
        ends = [e for e in log if isinstance(e, events.Finish)]
        assert len(ends) == 1
    return repeated

"""Cancelling a run interrupts the command it waits for, with real worker processes.

A worker process serving the runtime and agent roles runs a scripted run whose first move is a
long command (``sleep``, or a Python cell that sleeps).  Cancelled from the CLI or over HTTP, the
run ends (``error``, ``source: agent``, reason ``cancelled``) and the command is killed, its one
answer saying so, within 2 s of the ``run_cancel``.  The bound asserted is 2 s plus a margin of
1.5 s on a quiet 2-core machine, scaled by the load (the runtime looks for the cancel every
0.25 s; tests/kit/patience.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, cancel_run, follow_run, open_run
from riverbed.client.session import Bus
from riverbed.runtime import Limits, Runtime
from riverbed.runtime.paths import workspace_name
from riverbed.workers.agent_role import AgentHandler
from riverbed.workers.runtime_role import RuntimeHandler
from tests.kit.agent_faults import agent_cli_env, model_env, ready, server, start, workers
from tests.kit.agents import owners
from tests.kit.answers import check_exactly_one_answer
from tests.kit.cli import run as run_cli
from tests.kit.openai_server import OpenAIServer
from tests.kit.patience import within
from tests.kit.serve import bearer, new_key, running
from tests.kit.workers import WorkerProcess, spawn

pytestmark = [pytest.mark.anyio]

__all__ = ["agent_cli_env", "model_env", "server", "spawn", "start", "workers"]  # the fixtures this module shares


def bound() -> float:
    """Seconds from the ``run_cancel`` to the run's end and the command's answer (2 s + margin)."""
    return 2.0 + within(1.5)


def sleeping(marker: str) -> bool:
    """Whether a process whose command line holds ``marker`` runs on this machine."""
    for stat in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in stat.read_bytes():
                return True
        except OSError:
            continue
    return False


async def until(condition: Callable[[], bool], timeout: float) -> None:
    with anyio.fail_after(within(timeout)):
        while not condition():
            await anyio.sleep(0.05)


async def ended_and_answered(bus: Bus, session: str) -> tuple[events.Event, events.Observation]:
    """The event that ended the run and the answer of its one action, once both are logged."""
    with anyio.fail_after(within(30)):
        async for event in follow_run(bus, session, 1):
            last = event
        while True:
            log = await bus.session(session).events()
            answers = [e for e in log if isinstance(e, events.Observation) and e.cause is not None]
            if answers:
                return last, answers[0]
            await anyio.sleep(0.05)


async def test_cli_cancel_interrupts_a_running_command(
    bus: Bus,
    start: Callable[..., WorkerProcess],
    server: OpenAIServer,
    agent_cli_env: dict[str, str],
) -> None:
    server.clear()
    marker = "59.7301"
    server.reply(tool_calls=[("cmd_run", {"command": f"echo started; sleep {marker}"})])
    await ready(start("w1", ["runtime", "agent"]))
    env = agent_cli_env
    assert run_cli(env, "agent", "c1", "sleep a long time", "--detach").returncode == 0
    await until(lambda: sleeping(marker), 30)
    result = run_cli(env, "agent", "c1", "--cancel")
    asked = time.monotonic()
    assert result.returncode == 0, result.stderr.decode()
    last, answer = await ended_and_answered(bus, "c1")
    took = time.monotonic() - asked
    assert took <= bound(), f"the run ended {took:.2f}s after the cancel"
    assert isinstance(last, events.Error)
    assert (last.source, last.reason) == ("agent", "cancelled")
    assert isinstance(answer, events.CmdOutput)
    assert "the run was cancelled" in answer.content
    assert "started" in answer.content
    assert not answer.timed_out
    await until(lambda: not sleeping(marker), 5)  # killed, not left running
    await check_exactly_one_answer(bus, "c1")
    await anyio.sleep(0.5)
    assert [e.kind for e in await bus.session("c1").events()][-3:] in (
        ["run_cancel", "error", "cmd_output"],
        ["run_cancel", "cmd_output", "error"],
    )


async def test_http_cancel_interrupts_a_running_python_cell(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, workspace: Path
) -> None:
    server.clear()
    code = "import time\nprint('napping', flush=True)\nopen('napping', 'w').close()\ntime.sleep(59.7302)"
    server.reply(tool_calls=[("python_run", {"code": code})])
    await ready(start("w1", ["runtime", "agent"]))
    key = await new_key(bus, "acme")
    async with running(bus) as base, httpx.AsyncClient(base_url=base, timeout=within(30)) as http:
        opened = await http.post("/v1/sessions/p1/runs", json={"task": "nap"}, headers=bearer(key))
        assert opened.status_code == 202, opened.text
        napping = workspace / workspace_name("p1") / "napping"
        await until(napping.exists, 30)  # the cell is running (a loaded machine takes seconds to start it)
        cancelled = await http.post("/v1/sessions/p1/runs/cancel", headers=bearer(key))
        asked = time.monotonic()
        assert cancelled.status_code == 202, cancelled.text
        last, answer = await ended_and_answered(bus, "p1")
        took = time.monotonic() - asked
        rows = (await http.get("/v1/runs?state=cancelled", headers=bearer(key))).json()["runs"]
    assert took <= bound(), f"the run ended {took:.2f}s after the cancel"
    assert isinstance(last, events.Error)
    assert (last.source, last.reason) == ("agent", "cancelled")
    assert isinstance(answer, events.PythonOutput)
    assert "the run was cancelled" in answer.content
    assert not answer.timed_out
    await check_exactly_one_answer(bus, "p1")
    assert [r["session"] for r in rows] == ["p1"]


async def test_cancel_stops_a_command_left_running_after_its_answer(
    bus: Bus, workspace: Path, server: OpenAIServer
) -> None:
    """A command that outlived its answer (the soft timeout) is interrupted when the run is
    cancelled, though no action waits for it any more."""
    marker = "59.7303"
    server.clear()
    server.reply(tool_calls=[("cmd_run", {"command": f"sleep {marker}"})])
    server.reply(content="still thinking", delay=30)  # the model call in flight when the cancel comes
    runtime = Runtime(workspace_root=workspace, limits=Limits(soft_timeout=1.0))
    agent = AgentHandler(client=server.client(), model="test-model", retry_seconds=5)
    try:
        async with owners(bus, [RuntimeHandler(runtime), agent]):
            opened = await open_run(bus, "bg", "start something slow", limits=RunLimits(max_steps=5))
            with anyio.fail_after(within(30)):
                while len(server.requests) < 2:  # answered "still running"; the next call is in flight
                    await anyio.sleep(0.05)
            assert sleeping(marker)
            await cancel_run(bus, "bg")
            asked = time.monotonic()
            await until(lambda: not sleeping(marker), bound())
            took = time.monotonic() - asked
            with anyio.fail_after(within(10)):
                seen = [event async for event in follow_run(bus, "bg", opened.opened)]
    finally:
        with anyio.CancelScope(shield=True):
            await runtime.aclose()
            await agent.aclose()
    assert took <= bound()
    outputs = [e for e in seen if isinstance(e, events.CmdOutput)]
    assert len(outputs) == 1
    assert outputs[0].timed_out  # its answer came at the soft timeout, before the cancel
    last = seen[-1]
    assert isinstance(last, events.Error)
    assert last.reason == "cancelled"
    await check_exactly_one_answer(bus, "bg")

"""The agent role under faults, with real worker processes, Redis and the scripted model server.

Several runs are in flight on an agent worker that SIGKILLs itself at a named point of the
agent loop (before a model call, right after an ``llm_response`` is appended, between two
actions of one response), or is killed by the test while a model call is in flight, or
freezes (SIGSTOP) past its lease; a peer takes each run over after the lease.  Then, for
every run:

- it finishes (``finish`` from the agent);
- no action is appended twice (each tool call of each response has one action);
- each action has exactly one answer, and each command ran once (it appends a line to a file);
- no model call whose ``llm_response`` is in the log is made again (the server's journal holds
  one request per step; only a call in flight when its worker died may be repeated, once);
- a frozen worker, resumed after its runs were taken over, appends nothing;
- with two agent workers sharing eight runs, either one killed at a random moment costs nothing.

A worker drained by SIGTERM hands its open runs to a peer, which finishes them.  The CLI is
driven too: ``riverbed agent --detach``, ``riverbed runs``, ``riverbed agent --cancel``, and a
followed run that Ctrl-C detaches from goes on.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import follow_run, list_runs
from riverbed.client.session import Bus
from tests.kit.agent_faults import (  # noqa: F401  (fixtures)
    LEASE,
    RUNS,
    STEPS,
    agent_cli_env,
    all_finished,
    check_runs,
    model_env,
    open_runs,
    ready,
    script,
    server,
    session_of,
    spawn,
    start,
    step_of,
    stopped,
    wait_until,
    with_continue,
    workers,
)
from tests.kit.cli import riverbed_command
from tests.kit.cli import run as run_cli
from tests.kit.openai_server import OpenAIServer
from tests.kit.workers import WorkerProcess

pytestmark = [pytest.mark.anyio, pytest.mark.fault]


def script_with(server: OpenAIServer, before: Callable[[], None]) -> None:
    """The model's script anew, with ``before()`` called ahead of each answer (to slow it down)."""

    def respond(request: dict[str, Any]) -> dict[str, Any]:
        before()
        return script(request)

    server.clear()
    server.respond(respond, times=10_000)


async def runtime_and_agent(start: Callable[..., WorkerProcess], **agent_env: str) -> WorkerProcess:
    """A runtime worker ``rt`` and an agent worker ``a1`` (``agent_env`` added to its
    environment), both ready; returns the agent worker."""
    runtime = start("rt", ["runtime"])
    agent = start("a1", ["agent"], **agent_env)
    await ready(runtime, agent)
    return agent


@pytest.mark.parametrize(
    ("point", "nth"),
    # (``before_ack``: the batch's acknowledgement held for the loop's next read, never sent)
    [("agent_before_llm", 5), ("agent_after_response", 4), ("agent_between_actions", 3), ("before_ack", 4)],
)
async def test_a_worker_killed_in_the_loop_loses_nothing_and_repeats_nothing(
    bus: Bus,
    start: Callable[..., WorkerProcess],
    server: OpenAIServer,
    workspace: Path,
    point: str,
    nth: int,
) -> None:
    doomed = await runtime_and_agent(start, RIVERBED_CRASH_AT=f"{point}:{nth}")
    sessions = [f"{point.replace('_', '-')}-{i}" for i in range(RUNS)]
    await open_runs(bus, sessions)
    await wait_until(lambda: doomed.proc.poll() is not None, 60, f"the worker did not reach {point}")
    assert doomed.proc.returncode == -signal.SIGKILL
    peer = start("a2", ["agent"])
    await ready(peer)
    await all_finished(bus, sessions)
    # Only a call in flight on the killed worker (another run's, at the moment it died) may be repeated.
    assert await check_runs(bus, server, sessions, workspace) <= RUNS - 1


async def test_a_worker_killed_once_a_response_is_recorded_leaves_its_first_action_with_it(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer
) -> None:
    # No runtime worker: the action stays unanswered, and the log is what the killed worker left.
    doomed = start("a1", ["agent"], RIVERBED_CRASH_AT="agent_after_response:1")
    await ready(doomed)
    await open_runs(bus, ["atomic"])
    await wait_until(lambda: doomed.proc.poll() is not None, 60, "the worker did not record a response")
    assert doomed.proc.returncode == -signal.SIGKILL
    log = await bus.session("atomic").events()
    response, action = log[-2:]
    assert isinstance(response, events.LlmResponse), log
    assert isinstance(action, events.CmdRun), log
    assert action.cause == response.id
    assert (
        action.tool_call_id == response.tool_calls[0]["id"] == "atomic-0-a"
    )  # (its second waits for the first's answer)


async def test_a_model_call_in_flight_on_a_killed_worker_is_made_again_at_most_once(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, workspace: Path
) -> None:
    slow: list[float] = []

    def first_slowly() -> None:
        if not slow:  # the first call takes long enough for the test to kill its worker
            slow.append(time.monotonic())
            time.sleep(3)

    script_with(server, first_slowly)
    doomed = await runtime_and_agent(start)
    sessions = ["inflight-0", "inflight-1"]
    await open_runs(bus, sessions)
    await wait_until(lambda: bool(slow), 30, "no model call came")
    doomed.kill()
    peer = start("a2", ["agent"])
    await ready(peer)
    await all_finished(bus, sessions)
    assert 1 <= await check_runs(bus, server, sessions, workspace) <= len(sessions)


# agent_after_response:3: with a response just received (the other runs' calls in flight);
# model_connected:1: connected to the model server for a first call, its request not yet sent
# (a lease check made before connecting would let that request out once the worker resumes);
# model_sending:1: a first request about to be written, its head held to go with its body (a lease
# check made before that would let the request out once the worker resumes, completing it late).
@pytest.mark.parametrize("pause_at", ["agent_after_response:3", "model_connected:1", "model_sending:1"])
async def test_a_frozen_worker_appends_nothing_once_resumed(
    pause_at: str, bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, workspace: Path
) -> None:
    frozen = await runtime_and_agent(start, RIVERBED_PAUSE_AT=pause_at)
    sessions = [f"frozen-{i}" for i in range(RUNS)]
    await open_runs(bus, sessions)
    await wait_until(lambda: stopped(frozen), 60, "the worker did not freeze")
    peer = start("a2", ["agent"])
    await ready(peer)
    await all_finished(bus, sessions)
    lasts = {s: await bus.session(s).last_id() for s in sessions}
    os.kill(frozen.proc.pid, signal.SIGCONT)
    await wait_until(lambda: "session.fenced" in frozen.log_path.read_text(), 30, "the resumed worker went on")
    await anyio.sleep(1.0)  # (anything it still had to write would have been written by now)
    assert {s: await bus.session(s).last_id() for s in sessions} == lasts
    await check_runs(bus, server, sessions, workspace)  # (calls in flight when it froze were repeated once)


async def test_cli_detach_runs_and_cancel(
    bus: Bus,
    start: Callable[..., WorkerProcess],
    server: OpenAIServer,
    agent_cli_env: dict[str, str],
) -> None:
    env = agent_cli_env
    result = run_cli(env, "agent", "cli-1", "task for cli-1", "--detach", "--max-steps", "9")
    assert result.returncode == 0, result.stderr.decode()
    rows = [json.loads(line) for line in run_cli(env, "runs", "--json").stdout.splitlines()]
    assert [(r["session"], r["state"], r["worker"]) for r in rows] == [("cli-1", "waiting", None)]
    await runtime_and_agent(start)
    await all_finished(bus, ["cli-1"])
    status = json.loads(run_cli(env, "status", "--json").stdout)
    assert [r["role"] for r in status["roles"]] == ["runtime", "memory", "condenser", "agent"]
    rows = [json.loads(line) for line in run_cli(env, "runs", "--json", "--state", "finished").stdout.splitlines()]
    assert [(r["session"], r["steps"]) for r in rows] == [("cli-1", STEPS + 1)]
    assert rows[0]["tokens"] > 0
    # Followed live: the command ends with the run, printing its events.
    result = run_cli(env, "agent", "cli-2", "task for cli-2", timeout=90)
    assert result.returncode == 0, result.stderr.decode()
    assert b"finish" in result.stdout
    # Cancelled while a command runs.
    server.clear()
    server.reply(tool_calls=[("cmd_run", {"command": "sleep 2"})])
    server.reply(content="late", delay=30)  # the run stays open however long the CLI takes to start
    result = run_cli(env, "agent", "cli-3", "wait a little", "--detach")
    assert result.returncode == 0
    with anyio.fail_after(30):
        async for event in bus.session("cli-3").log(1, follow=True):
            if isinstance(event, events.CmdRun):
                break
    result = run_cli(env, "agent", "cli-3", "--cancel")
    assert result.returncode == 0, result.stderr.decode()
    with anyio.fail_after(30):
        async for event in follow_run(bus, "cli-3", 1):
            last = event
    assert isinstance(last, events.Error)
    assert last.reason == "cancelled"
    result = run_cli(env, "agent", "cli-3", "--cancel")
    assert result.returncode == 2
    assert b"no open run" in result.stderr


async def test_a_draining_worker_hands_its_runs_to_a_peer(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, workspace: Path
) -> None:
    # The model answers no more while the peer starts (seconds on a loaded machine): the runs
    # are still going when the drain begins, however slow the start-up.
    open_gate = threading.Event()
    open_gate.set()

    def slow_when_open() -> None:
        open_gate.wait(60)
        time.sleep(2.0)

    script_with(server, slow_when_open)
    draining = await runtime_and_agent(start)
    sessions = [f"drain-{i}" for i in range(RUNS)]
    await open_runs(bus, sessions)
    with anyio.fail_after(30):  # under way: the first run has had a model call
        async for event in bus.session(sessions[0]).log(1, follow=True):
            if isinstance(event, events.LlmResponse):
                break
    open_gate.clear()
    peer = start("a2", ["agent"])
    await ready(peer)
    open_gate.set()
    assert await anyio.to_thread.run_sync(draining.terminate) == 0
    running = [row.session for row in await list_runs(bus) if row.state in ("running", "waiting")]
    assert running, "every run ended before the drain: nothing was handed over"
    await all_finished(bus, sessions)
    await check_runs(bus, server, sessions, workspace)
    taken = peer.log_path.read_text()
    assert all(f'"session": "{s}"' in taken or f'"session":"{s}"' in taken for s in running), taken[-2000:]


async def test_ctrl_c_detaches_from_a_followed_run_which_goes_on(
    bus: Bus,
    start: Callable[..., WorkerProcess],
    server: OpenAIServer,
    agent_cli_env: dict[str, str],
    workspace: Path,
) -> None:
    script_with(server, lambda: time.sleep(0.5))
    await runtime_and_agent(start)
    follower = await anyio.to_thread.run_sync(
        lambda: subprocess.Popen(
            [*riverbed_command(), "agent", "ctrl-c", "task for ctrl-c"],
            env=agent_cli_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    )
    try:
        with anyio.fail_after(30):  # it follows: the run's first model response is on the log
            async for event in bus.session("ctrl-c").log(1, follow=True):
                if isinstance(event, events.LlmResponse):
                    break
        follower.send_signal(signal.SIGINT)
        out, err = await anyio.to_thread.run_sync(lambda: follower.communicate(timeout=20))
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, err.decode()
    assert b"llm_response" in out
    assert b"Ctrl-C detaches" in err
    await all_finished(bus, ["ctrl-c"])  # the run went on without its follower
    await check_runs(bus, server, ["ctrl-c"], workspace)


async def test_two_agent_workers_share_runs_and_one_is_killed_at_a_random_moment(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, workspace: Path
) -> None:
    runtime = start("rt", ["runtime"])
    first, second = start("a1", ["agent"]), start("a2", ["agent"])
    await ready(runtime, first, second)
    sessions = [f"shared-{i}" for i in range(2 * RUNS)]
    await open_runs(bus, sessions)
    responses = 0
    with anyio.fail_after(60):  # some way into the runs: a third of their model responses are in
        while responses < len(sessions) * (STEPS + 1) // 3:
            responses = 0
            for session in sessions:
                responses += sum(isinstance(e, events.LlmResponse) for e in await bus.session(session).events())
            await anyio.sleep(random.uniform(0.0, 0.1))
    victim = random.choice([first, second])
    victim.kill()
    await all_finished(bus, sessions)
    await check_runs(bus, server, sessions, workspace)
    survivor = second if victim is first else first
    assert survivor.proc.poll() is None

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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.agent.client import Bus
from riverbed.agent.hosted import RunLimits, follow_run, list_runs, open_run
from riverbed.runtime.paths import workspace_name
from tests.openai_server import OpenAIServer
from tests.test_cli import riverbed_command
from tests.test_cli import run as run_cli
from tests.test_failover import check_exactly_one_answer
from tests.workerproc import WorkerProcess

pytestmark = [pytest.mark.anyio, pytest.mark.fault]

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
def start(
    workers: list[WorkerProcess],
    redis_url: str,
    prefix: str,
    workspace: Path,
    tmp_path: Path,
    model_env: dict[str, str],
) -> Callable[..., WorkerProcess]:
    def start(name: str, roles: list[str], **env: str) -> WorkerProcess:
        worker = WorkerProcess(
            roles,
            name=name,
            redis_url=redis_url,
            prefix=prefix,
            workspace=workspace,
            lease=LEASE,
            extra_env={**model_env, **env},
            log_dir=tmp_path,
        )
        workers.append(worker)
        return worker

    return start


async def ready(*started: WorkerProcess) -> None:
    for worker in started:
        await anyio.to_thread.run_sync(worker.wait_ready)


async def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    with anyio.fail_after(timeout):
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
    with anyio.fail_after(timeout):
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


@pytest.mark.parametrize(
    ("point", "nth"),
    [("agent_before_llm", 5), ("agent_after_response", 4), ("agent_between_actions", 3)],
)
async def test_a_worker_killed_in_the_loop_loses_nothing_and_repeats_nothing(
    bus: Bus,
    start: Callable[..., WorkerProcess],
    server: OpenAIServer,
    workspace: Path,
    point: str,
    nth: int,
) -> None:
    runtime = start("rt", ["runtime"])
    doomed = start("a1", ["agent"], RIVERBED_CRASH_AT=f"{point}:{nth}")
    await ready(runtime, doomed)
    sessions = [f"{point.replace('_', '-')}-{i}" for i in range(RUNS)]
    await open_runs(bus, sessions)
    await wait_until(lambda: doomed.proc.poll() is not None, 60, f"the worker did not reach {point}")
    assert doomed.proc.returncode == -signal.SIGKILL
    peer = start("a2", ["agent"])
    await ready(peer)
    await all_finished(bus, sessions)
    # Only a call in flight on the killed worker (another run's, at the moment it died) may be repeated.
    assert await check_runs(bus, server, sessions, workspace) <= RUNS - 1


async def test_a_model_call_in_flight_on_a_killed_worker_is_made_again_at_most_once(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, workspace: Path
) -> None:
    slow: list[float] = []

    def slowly(request: dict[str, Any]) -> dict[str, Any]:
        if not slow:  # the first call takes long enough for the test to kill its worker
            slow.append(time.monotonic())
            time.sleep(3)
        return script(request)

    server.clear()
    server.respond(slowly, times=10_000)
    runtime = start("rt", ["runtime"])
    doomed = start("a1", ["agent"])
    await ready(runtime, doomed)
    sessions = ["inflight-0", "inflight-1"]
    await open_runs(bus, sessions)
    await wait_until(lambda: bool(slow), 30, "no model call came")
    doomed.kill()
    peer = start("a2", ["agent"])
    await ready(peer)
    await all_finished(bus, sessions)
    assert 1 <= await check_runs(bus, server, sessions, workspace) <= len(sessions)


async def test_a_frozen_worker_appends_nothing_once_resumed(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, workspace: Path
) -> None:
    runtime = start("rt", ["runtime"])
    frozen = start("a1", ["agent"], RIVERBED_PAUSE_AT="agent_after_response:3")
    await ready(runtime, frozen)
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
    cli_env: dict[str, str],
    model_env: dict[str, str],
) -> None:
    env = {**cli_env, **model_env}
    result = run_cli(env, "agent", "cli-1", "task for cli-1", "--detach", "--max-steps", "9")
    assert result.returncode == 0, result.stderr.decode()
    rows = [json.loads(line) for line in run_cli(env, "runs", "--json").stdout.splitlines()]
    assert [(r["session"], r["state"], r["worker"]) for r in rows] == [("cli-1", "running", None)]
    runtime = start("rt", ["runtime"])
    agent = start("a1", ["agent"])
    await ready(runtime, agent)
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
    def slowly(request: dict[str, Any]) -> dict[str, Any]:
        time.sleep(2.0)  # the runs outlast a peer's start-up (seconds on a loaded machine)
        return script(request)

    server.clear()
    server.respond(slowly, times=10_000)
    runtime = start("rt", ["runtime"])
    draining = start("a1", ["agent"])
    await ready(runtime, draining)
    sessions = [f"drain-{i}" for i in range(RUNS)]
    await open_runs(bus, sessions)
    with anyio.fail_after(30):  # under way: the first run has had a model call
        async for event in bus.session(sessions[0]).log(1, follow=True):
            if isinstance(event, events.LlmResponse):
                break
    peer = start("a2", ["agent"])
    await ready(peer)
    assert await anyio.to_thread.run_sync(draining.terminate) == 0
    running = [row.session for row in await list_runs(bus, state="running")]
    assert running, "every run ended before the drain: nothing was handed over"
    await all_finished(bus, sessions)
    await check_runs(bus, server, sessions, workspace)
    taken = peer.log_path.read_text()
    assert all(f'"session": "{s}"' in taken or f'"session":"{s}"' in taken for s in running), taken[-2000:]


async def test_ctrl_c_detaches_from_a_followed_run_which_goes_on(
    bus: Bus,
    start: Callable[..., WorkerProcess],
    server: OpenAIServer,
    cli_env: dict[str, str],
    model_env: dict[str, str],
    workspace: Path,
) -> None:
    def slowly(request: dict[str, Any]) -> dict[str, Any]:
        time.sleep(0.5)
        return script(request)

    server.clear()
    server.respond(slowly, times=10_000)
    runtime = start("rt", ["runtime"])
    agent = start("a1", ["agent"])
    await ready(runtime, agent)
    follower = await anyio.to_thread.run_sync(
        lambda: subprocess.Popen(
            [*riverbed_command(), "agent", "ctrl-c", "task for ctrl-c"],
            env={**cli_env, **model_env},
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

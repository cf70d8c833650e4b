"""Sub-agents, with real worker processes, Redis and the scripted model server.

A run's model calls ``delegate``; the agent role creates a child session (``delegated``, the
task, ``run_started``) whose run it serves like any other, and answers the parent's action
once with a ``delegate_result`` when the child's run ends:

- three delegate calls in one response run in parallel, each child once, each answered once,
  and the parent finishes with their results;
- past the depth or fan-out limit, a ``delegate`` is answered by an ``error`` the model reads;
- cancelling a parent cancels its children, and theirs;
- an agent worker SIGKILLed while delegating (before a child is created, or before a child's
  result goes to its parent), with runs in flight: a peer goes on, each child is created once,
  each delegate answered once, no recorded model call asked again;
- a worker frozen (SIGSTOP) while delegating, resumed after a peer finished its tree, appends
  nothing;
- ``riverbed runs`` names each child's parent, ``view`` and ``log`` show the tree, and a fork of
  a child keeps its pointer but never answers the parent.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, cancel_run, list_runs, open_run
from riverbed.agent.replay import fork
from riverbed.agent.runs import child_session, fold_runs
from riverbed.agent.tools import ROLE_TOOL_ACTIONS, tool_names, tools
from riverbed.client.session import Bus
from tests.kit.agent_faults import stopped
from tests.kit.cli import run as run_cli
from tests.kit.delegation import (  # noqa: F401  (fixtures)
    LEASE,
    all_answered,
    answers,
    call,
    check_child,
    check_model_calls,
    finish,
    model_env,
    ran_a_command,
    ready,
    results_of,
    run_end,
    script,
    server,
    spawn,
    start,
    step_of,
    task_of,
    workers,
)
from tests.kit.openai_server import OpenAIServer
from tests.kit.workers import WorkerProcess

pytestmark = [pytest.mark.anyio]

# --- tests -----------------------------------------------------------------------------------


async def test_three_parallel_children_finish_and_the_parent_gets_each_result_once(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, workspace: Path
) -> None:
    runtime, agent = start("rt", ["runtime"]), start("a1", ["agent"])
    await ready(runtime, agent)
    await open_run(bus, "root", "split root 3", limits=RunLimits(max_steps=5, max_tokens=90_000))
    last = await run_end(bus, "root")
    assert isinstance(last, events.Finish), last
    assert last.final_thought == "root.0 done | root.1 done | root.2 done"
    assert server.requests[0]["parallel_tool_calls"] is True  # the model may make several calls at once
    answered = await answers(bus, "root")
    assert len(answered) == 3
    log = await bus.session("root").events()
    # The three calls of one response went on the log in one write, before any child answered.
    delegates = [e for e in log if isinstance(e, events.Delegate)]
    assert [d.id for d in delegates] == list(range(delegates[0].id or 0, (delegates[0].id or 0) + 3))
    first_answer = min(e.id or 0 for es in answered.values() for e in es)
    assert first_answer > (delegates[-1].id or 0)
    spent = 0
    for action, replies in answered.items():
        assert len(replies) == 1, f"delegate {action} answered {len(replies)} times"
        (reply,) = replies
        assert isinstance(reply, events.DelegateResult)
        assert reply.session == child_session("root", action)
        index = [d.id for d in delegates].index(action)
        assert (reply.state, reply.content) == ("finished", f"root.{index} done")
        child_log = await check_child(bus, "root", action)
        started = child_log[2]
        assert isinstance(started, events.RunStarted)
        assert started.max_tokens is not None
        assert started.max_tokens <= 90_000 // 3  # its share of what the parent had left
        spent += reply.tokens
        assert reply.tokens > 0
    # The children's tokens count in the parent's run.
    run = fold_runs(log).run
    assert run is not None
    assert run.child_tokens == spent
    assert run.tokens == run.prompt_tokens + run.completion_tokens + spent
    # Each leaf ran its command once, in its own session.
    logs = {"root": log} | {
        child_session("root", a): await bus.session(child_session("root", a)).events() for a in answered
    }
    for session, child_log in logs.items():
        if session != "root":
            assert sum(isinstance(e, events.CmdRun) for e in child_log) == 1
    assert check_model_calls(server, logs) == 0
    rows = {row.session: row for row in await list_runs(bus)}
    assert rows["root"].parent is None
    assert sorted(rows["root"].children) == sorted(logs.keys() - {"root"})
    assert all(rows[s].parent == "root" and rows[s].state == "finished" for s in logs if s != "root")


async def test_past_the_depth_limit_the_delegate_is_an_error_the_model_reads(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer
) -> None:
    runtime, agent = start("rt", ["runtime"]), start("a1", ["agent"], RIVERBED_AGENT_MAX_DEPTH="2")
    await ready(runtime, agent)
    await open_run(bus, "deep", "nest deep 0", limits=RunLimits(max_steps=5))
    last = await run_end(bus, "deep")
    assert isinstance(last, events.Finish), last
    level1 = child_session("deep", next(iter(await answers(bus, "deep"))))
    level2 = child_session(level1, next(iter(await answers(bus, level1))))
    (refused,) = (await answers(bus, level2)).values()
    assert [e.kind for e in refused] == ["error"]
    error = refused[0]
    assert isinstance(error, events.Error)
    assert error.reason == "delegate_refused"
    assert "2 levels deep" in error.content
    assert "RIVERBED_AGENT_MAX_DEPTH" in error.content
    # The model read it, and the answer went up the tree.
    assert "2 levels deep" in last.final_thought
    assert last.final_thought.startswith("level 0 got: level 1 got: level 2 got: error: delegate refused")
    assert not await bus.log_store.exists(child_session(level2, error.cause or 0))


async def test_past_the_fanout_limit_the_delegate_is_an_error_the_model_reads(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer
) -> None:
    runtime, agent = start("rt", ["runtime"]), start("a1", ["agent"], RIVERBED_AGENT_MAX_FANOUT="2")
    await ready(runtime, agent)
    await open_run(bus, "wide", "split wide 3", limits=RunLimits(max_steps=5))
    last = await run_end(bus, "wide")
    assert isinstance(last, events.Finish), last
    answered = await answers(bus, "wide")
    kinds = [[e.kind for e in replies] for replies in answered.values()]
    assert kinds == [["delegate_result"], ["delegate_result"], ["error"]]
    error = list(answered.values())[2][0]
    assert isinstance(error, events.Error)
    assert "handed out 2 tasks already" in error.content
    assert "RIVERBED_AGENT_MAX_FANOUT" in error.content
    assert last.final_thought.startswith("wide.0 done | wide.1 done | error: delegate refused")
    assert not await bus.log_store.exists(child_session("wide", error.cause or 0))


async def test_cancelling_a_parent_cancels_its_children_and_theirs(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer
) -> None:
    runtime, agent = start("rt", ["runtime"]), start("a1", ["agent"])
    await ready(runtime, agent)
    await open_run(bus, "boss", "wait boss", limits=RunLimits(max_steps=5))
    # Wait until both grandchildren run their long command.
    with anyio.fail_after(60):
        while True:
            children = [child_session("boss", a) for a in await answers(bus, "boss")]
            grandchildren = [child_session(c, a) for c in children for a in await answers(bus, c)]
            running = [
                g for g in grandchildren if any(isinstance(e, events.CmdRun) for e in await bus.session(g).events())
            ]
            if len(running) == 2:
                break
            await anyio.sleep(0.1)
    await cancel_run(bus, "boss")
    for session in ["boss", *children, *grandchildren]:
        last = await run_end(bus, session, timeout=30)
        assert isinstance(last, events.Error), (session, last)
        assert last.reason == "cancelled", (session, last)
    # Every delegate still has exactly one answer: the child's "cancelled".
    for session in ["boss", *children]:
        for action, replies in (await all_answered(bus, session)).items():
            assert [e.kind for e in replies] == ["delegate_result"], (session, action, replies)
            reply = replies[0]
            assert isinstance(reply, events.DelegateResult)
            assert reply.state == "cancelled"


@pytest.mark.fault
@pytest.mark.parametrize(("point", "nth"), [("agent_delegating", 2), ("agent_delegating", 4), ("agent_reporting", 2)])
async def test_a_worker_killed_while_delegating_loses_nothing_and_repeats_nothing(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, point: str, nth: int
) -> None:
    runtime = start("rt", ["runtime"])
    doomed = start("a1", ["agent"], RIVERBED_CRASH_AT=f"{point}:{nth}")
    await ready(runtime, doomed)
    roots = [f"{point.replace('_', '-')}-{i}" for i in range(2)]
    for root in roots:
        await open_run(bus, root, f"split {root} 3", limits=RunLimits(max_steps=5))
    with anyio.fail_after(60):
        while doomed.proc.poll() is None:
            await anyio.sleep(0.05)
    assert doomed.proc.returncode == -signal.SIGKILL
    peer = start("a2", ["agent"])
    await ready(peer)
    logs: dict[str, list[events.Event]] = {}
    for root in roots:
        last = await run_end(bus, root, timeout=90)
        assert isinstance(last, events.Finish), (root, last)
        logs[root] = await bus.session(root).events()
        answered = await answers(bus, root)
        assert len(answered) == 3
        for action, replies in answered.items():
            assert [e.kind for e in replies] == ["delegate_result"], (root, action, replies)
            logs[child_session(root, action)] = await check_child(bus, root, action)
        # No action appended twice: each tool call of each response has one action.
        for response in (e for e in logs[root] if isinstance(e, events.LlmResponse)):
            actions = [e for e in logs[root] if isinstance(e, events.Action) and e.cause == response.id]
            assert [a.tool_call_id for a in actions] == [c["id"] for c in response.tool_calls]
    # Only a call in flight on the killed worker may have been asked twice: at most one per run.
    assert check_model_calls(server, logs) <= len(logs)


async def test_a_fork_of_a_child_keeps_its_parent_pointer_and_never_answers_the_parent(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, cli_env: dict[str, str]
) -> None:
    runtime, agent = start("rt", ["runtime"]), start("a1", ["agent"])
    await ready(runtime, agent)
    await open_run(bus, "top", "split top 1", limits=RunLimits(max_steps=5))
    assert isinstance(await run_end(bus, "top"), events.Finish)
    (action,) = await answers(bus, "top")
    child = child_session("top", action)
    await fork(bus, child, await bus.session(child).last_id(), "top-copy", workspace="empty")
    fold = fold_runs(await bus.session("top-copy").events())
    assert fold.delegated is not None
    assert fold.delegated.parent == "top"
    assert fold.reports_to is None  # its runs never answer the parent's delegate
    await open_run(bus, "top-copy", "leaf again", limits=RunLimits(max_steps=3))
    assert isinstance(await run_end(bus, "top-copy"), events.Finish)
    assert [e.kind for e in (await answers(bus, "top"))[action]] == ["delegate_result"]
    # The CLI shows the tree: the child's parent in `runs`, its header in `view`, the child in the parent's log.
    runs = await anyio.to_thread.run_sync(lambda: run_cli(cli_env, "runs", "--json"))
    rows = {row["session"]: row for row in map(json.loads, runs.stdout.splitlines())}
    assert (rows[child]["parent"], rows["top"]["children"]) == ("top", [child])
    table = (await anyio.to_thread.run_sync(lambda: run_cli(cli_env, "runs"))).stdout.decode()
    assert any(line.split()[0] == child and line.split()[-1] == "top" for line in table.splitlines()[1:])
    viewed = (await anyio.to_thread.run_sync(lambda: run_cli(cli_env, "view", "top-copy"))).stdout.decode()
    assert f"sub-agent of top (its delegate {action}; depth 1)" in viewed
    logged = (await anyio.to_thread.run_sync(lambda: run_cli(cli_env, "log", "top"))).stdout.decode()
    assert f"{child} finished: top.0 done" in logged


@pytest.mark.fault
async def test_a_worker_frozen_while_delegating_appends_nothing_once_resumed(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer
) -> None:
    runtime = start("rt", ["runtime"])
    frozen = start("a1", ["agent"], RIVERBED_PAUSE_AT="agent_delegating:2")
    await ready(runtime, frozen)
    await open_run(bus, "cold", "split cold 3", limits=RunLimits(max_steps=5))
    with anyio.fail_after(60):
        while not stopped(frozen):
            await anyio.sleep(0.05)
    peer = start("a2", ["agent"])
    await ready(peer)
    assert isinstance(await run_end(bus, "cold", timeout=90), events.Finish)
    sessions = ["cold", *(child_session("cold", a) for a in await all_answered(bus, "cold"))]
    lasts = {s: await bus.session(s).last_id() for s in sessions}
    frozen.proc.send_signal(signal.SIGCONT)
    with anyio.fail_after(30):
        while "session.fenced" not in frozen.log_path.read_text():
            await anyio.sleep(0.05)
    await anyio.sleep(1.0)  # (anything it still had to write would have been written by now)
    assert {s: await bus.session(s).last_id() for s in sessions} == lasts
    for action in await answers(bus, "cold"):
        await check_child(bus, "cold", action)


@pytest.mark.fault
@pytest.mark.parametrize(("point", "session"), [("agent_delegating", "early"), ("agent_creating", "late")])
async def test_a_parent_cancelled_before_its_children_exist_answers_each_delegate_and_its_frozen_worker_adds_nothing(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer, point: str, session: str
) -> None:
    """Frozen before its first child is made sure of (``agent_delegating``), or after every check
    just before that child's session is made (``agent_creating``: the delegate is claimed with
    its fencing token first); the run is cancelled and a peer ends it meanwhile; resumed, the
    frozen worker appends nothing and makes no orphan child."""
    runtime = start("rt", ["runtime"])
    frozen = start("a1", ["agent"], RIVERBED_PAUSE_AT=f"{point}:1")
    await ready(runtime, frozen)
    await open_run(bus, session, f"split {session} 3", limits=RunLimits(max_steps=5))
    with anyio.fail_after(60):
        while not stopped(frozen):
            await anyio.sleep(0.05)
    await cancel_run(bus, session)
    peer = start("a2", ["agent"])
    await ready(peer)
    last = await run_end(bus, session, timeout=60)
    assert isinstance(last, events.Error)
    assert last.reason == "cancelled"
    answered = await all_answered(bus, session)
    assert len(answered) == 3
    for replies in answered.values():
        assert [(e.kind, getattr(e, "reason", None)) for e in replies] == [("error", "delegate_refused")]
        assert "before a sub-agent took this task" in getattr(replies[0], "content", "")
    lasts = await bus.session(session).last_id()
    frozen.proc.send_signal(signal.SIGCONT)
    with anyio.fail_after(30):
        while "session.fenced" not in frozen.log_path.read_text():
            await anyio.sleep(0.05)
    await anyio.sleep(1.0)  # (anything it still had to write would have been written by now)
    assert await bus.session(session).last_id() == lasts
    for action in answered:
        assert not await bus.log_store.exists(child_session(session, action)), f"an orphan child of {action}"


def test_the_agent_role_offers_delegate_and_the_in_process_loop_does_not() -> None:
    """(Nothing would answer a delegate in the in-process loop: only the role offers it.)"""
    role_tools = tools(ROLE_TOOL_ACTIONS)
    assert "delegate" in [t["function"]["name"] for t in role_tools]
    assert "delegate" not in tool_names()
    assert "delegate" not in [t["function"]["name"] for t in tools()]
    schema = next(t["function"]["parameters"] for t in role_tools if t["function"]["name"] == "delegate")
    assert schema["required"] == ["task"]
    assert set(schema["properties"]) == {"task", "max_steps", "max_tokens", "max_cost"}

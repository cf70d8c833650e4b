"""Fair share between tenants, attacked with real worker processes and the scripted model.

A hostile tenant's run delegates a tree of sub-agents (a delegation bomb, scaled to the test's
workers: four children at each of two levels, each leaf a long command) on two workers whose
capacity the bomb outnumbers.  Meanwhile another tenant:

- acts a command: it is answered within seconds, not after the bomb's commands end;
- opens a run: its first command is answered within seconds too, and the run finishes.

And the runtime role took only the bomb's sessions that ran a command: the sessions that only
delegated were never announced to it.  (With ``RIVERBED_TENANT_SHARE=1`` the bomb holds every
slot, and the other tenant waits for the bomb's commands to end: the test fails.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, cancel_run, open_run
from riverbed.agent.runs import child_session
from riverbed.client.session import Bus
from tests.kit.delegation import (  # noqa: F401  (fixtures)
    LEASE,
    call,
    finish,
    model_env,
    ready,
    run_end,
    spawn,
    start,
    step_of,
    task_of,
    workers,
)
from tests.kit.openai_server import OpenAIServer
from tests.kit.patience import within
from tests.kit.workers import WorkerProcess

pytestmark = [pytest.mark.anyio, pytest.mark.security]

FANOUT, DEPTH, CAPACITY, LEAF_SECONDS = (int(v) for v in os.environ.get("RIVERBED_TEST_BOMB", "4,2,8,25").split(","))
"""The bomb's children per run and levels, each worker's sessions per role (a tenant's share: half
of them), and how long each leaf's command runs: the bomb's 16 leaves outnumber two workers' 8
(``RIVERBED_TEST_BOMB=8,3,100,120`` is the size of the attack: 584 children, the default capacity)."""
FIRST_ANSWER = 5.0
"""How soon another tenant's first command is answered (on a quiet machine) while the bomb runs."""


def bomb(request: dict[str, Any]) -> dict[str, Any]:
    """``bomb NAME D``: delegate :data:`FANOUT` ``bomb NAME.i D-1`` at once, then finish; at
    depth 0, run a long command, then finish.  ``calm NAME``: one short command, then finish."""
    task, step = task_of(request), step_of(request)
    verb, name, *rest = task.split()
    key = f"{name}-{step}"
    if step > 0:
        return finish(f"{name} done", key)
    if verb == "calm":
        return {"tool_calls": [call("cmd_run", {"command": f"echo {name}"}, key)]}
    depth = int(rest[0])
    if depth == 0:
        command = {"command": f"sleep {LEAF_SECONDS}", "blocking": True, "timeout": 120}
        return {"tool_calls": [call("cmd_run", command, key)]}
    calls = [call("delegate", {"task": f"bomb {name}.{i} {depth - 1}"}, f"{key}-{i}") for i in range(FANOUT)]
    return {"tool_calls": calls}


@pytest.fixture
def server() -> Any:
    with OpenAIServer(model="test-model") as server:
        server.respond(bomb, times=10_000)
        yield server


async def bomb_tree(bus: Bus) -> dict[str, int]:
    """The bomb's sessions created so far -> their depth left (read from their tasks)."""
    out: dict[str, int] = {}
    todo = ["bomb"]
    while todo:
        session = todo.pop()
        log = await bus.session(session).events()
        task = next((e.content for e in log if isinstance(e, events.Message) and e.source == "user"), None)
        if task is None:
            continue
        out[session] = int(task.split()[2])
        todo += [child_session(session, e.id) for e in log if isinstance(e, events.Delegate) and e.id]
    return out


async def commands_running(bus: Bus, sessions: list[str]) -> int:
    """How many of ``sessions`` have a command on their log, not answered yet."""
    count = 0
    for session in sessions:
        log = await bus.session(session).events()
        count += any(isinstance(e, events.CmdRun) for e in log) and not any(
            isinstance(e, events.CmdOutput) for e in log
        )
    return count


async def first_output(bus: Bus, session: str, since: float, timeout: float) -> float:
    """Seconds from ``since`` until ``session``'s first command output is on its log."""
    with anyio.fail_after(timeout):
        while True:
            if any(isinstance(e, events.CmdOutput) for e in await bus.session(session).events()):
                return time.monotonic() - since
            await anyio.sleep(0.05)


async def test_a_delegation_bomb_does_not_delay_another_tenants_first_answer(
    bus: Bus, start: Callable[..., WorkerProcess], server: OpenAIServer
) -> None:
    nodes = [
        start(f"w{i}", ["runtime", "agent"], RIVERBED_CONCURRENCY=str(CAPACITY), RIVERBED_TENANT_SHARE="0.5")
        for i in range(2)
    ]
    await ready(*nodes)
    await open_run(
        bus, "bomb", f"bomb b {DEPTH}", tenant="hostile", limits=RunLimits(max_steps=4, max_tokens=1_000_000)
    )
    # The bomb holds its share: as many leaves run their long command as two workers let it.
    with anyio.fail_after(within(60 + FANOUT**DEPTH)):
        while (
            await commands_running(bus, [s for s, depth in (await bomb_tree(bus)).items() if depth == 0]) < CAPACITY - 2
        ):
            await anyio.sleep(0.2)

    # Another tenant's command, acted directly, and its run's first command.
    began = time.monotonic()
    answer = await bus.session("calm-act", tenant="calm").act(events.CmdRun(command="echo calm"), timeout=60)
    acted = time.monotonic() - began
    assert isinstance(answer, events.CmdOutput), answer
    assert "calm" in answer.content, answer
    began = time.monotonic()
    await open_run(bus, "calm-run", "calm c", tenant="calm", limits=RunLimits(max_steps=3))
    ran = await first_output(bus, "calm-run", began, within(60))
    print(f"another tenant's command answered in {acted:.2f}s, its run's first command in {ran:.2f}s")
    assert acted <= within(FIRST_ANSWER), f"another tenant's command waited {acted:.1f}s behind the bomb"
    assert ran <= within(FIRST_ANSWER), f"another tenant's run waited {ran:.1f}s for its first answer"
    last = await run_end(bus, "calm-run", timeout=30)
    assert isinstance(last, events.Finish), last

    # The runtime role took only the bomb's sessions that ran a command.
    sessions = await bomb_tree(bus)
    assert len(sessions) <= sum(FANOUT**level for level in range(DEPTH + 1)), sorted(sessions)
    assert sum(depth == DEPTH - 1 for depth in sessions.values()) == FANOUT  # (the bomb is well under way)
    for session, depth in sessions.items():
        fence = await bus.redis.hget(bus.keys.meta(session), "fence:runtime")
        assert depth == 0 or fence is None, f"{session} only delegates, yet the runtime role took it"
    # The bomb is still going, its leaves beyond its share waiting (set aside); a cancel ends it.
    leaves = [s for s, depth in sessions.items() if depth == 0]
    assert await commands_running(bus, leaves) <= 2 * (CAPACITY // 2)
    await cancel_run(bus, "bomb", tenant="hostile")
    last = await run_end(bus, "bomb", timeout=60)
    assert isinstance(last, events.Finish | events.Error), last

"""How many runs an agent worker takes on at once (``workers/agent_pace.py``).

The pace itself, on a clock the tests move: it grows while steps cost the role what they cost
on an idle worker and the worker uses its limit, shrinks below the runs served once they cost
more, never below its floor, and waits for enough steps to tell.

The role under it, with real Redis, owners and the scripted model server: a worker whose pace
has room for so many runs never serves more, the runs past it wait and all finish, and a run
waiting only for its sub-agents leaves its room to them (one that took it would wait forever
for children no worker takes).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from riverbed import events
from riverbed.agent.hosted import RunLimits, open_run
from riverbed.client.session import Bus
from riverbed.workers.agent_pace import (
    GROW,
    IDLE_ROOM,
    LAG_LIMIT,
    LAG_PROBE,
    MIN_STEPS,
    SHRINK,
    START,
    START_GROW,
    WINDOW,
    MachineIdle,
    Pace,
    own_cgroup,
)
from tests.kit.agent_role import roles
from tests.kit.delegation import call, finish, run_end, script, task_of
from tests.kit.openai_server import OpenAIServer

# --- the pace, on a clock the tests move -------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def window(pace: Pace, clock: Clock, served: int, steps: list[float]) -> int:
    """One window in which ``steps`` were made; the room the pace gives after it."""
    for seconds in steps:
        pace.observe(seconds)
    clock.now += WINDOW
    return pace.room(served)


def test_it_starts_with_room_for_a_few_doubles_until_steps_cost_more_then_grows_by_a_quarter() -> None:
    clock = Clock()
    pace = Pace(4, clock=clock)
    assert pace.room(0) == START
    assert pace.room(START) == 0
    limits = []
    for _ in range(4):
        window(pace, clock, int(pace.limit), [0.004] * 5)
        limits.append(pace.limit)
    assert limits == pytest.approx([START * START_GROW**k for k in range(1, 5)])
    assert pace.room(int(pace.limit) - 3) == 3
    # Steps cost more: it shrinks below the runs served, and from then on grows by a quarter.
    served = int(pace.limit)
    assert window(pace, clock, served, [0.010] * 5) == 0
    assert pace.limit == pytest.approx(served * SHRINK)
    shrunk = pace.limit
    window(pace, clock, int(pace.limit), [0.004] * 5)
    assert pace.limit == pytest.approx(shrunk * GROW)


def test_steps_that_cost_more_shrink_it_below_the_runs_served_but_never_below_its_floor() -> None:
    clock = Clock()
    pace = Pace(2, clock=clock)
    for _ in range(2):
        window(pace, clock, int(pace.limit), [0.004] * 5)
    grown = pace.limit
    assert grown > 20
    served = int(grown)
    assert window(pace, clock, served, [0.010] * 5) == 0  # two and a half times the baseline
    assert pace.limit == pytest.approx(served * SHRINK)
    for _ in range(20):
        assert window(pace, clock, served, [0.010] * 5) == 0
    assert pace.limit == 2  # its floor: a worker serving fewer runs than this takes more whatever the pace
    assert pace.room(1) == 1
    # A cost that lasts becomes the baseline (it drifts up a little each window): it grows again.
    for _ in range(60):
        window(pace, clock, int(pace.limit), [0.010] * 5)
    assert pace.limit > 2


def test_a_small_limit_grows_by_a_whole_run_at_least() -> None:
    clock = Clock()
    pace = Pace(1, clock=clock)
    window(pace, clock, START, [0.004] * 5)
    for _ in range(30):
        window(pace, clock, 1, [0.010] * 5)
    assert pace.limit == 1
    served = []
    for _ in range(3):  # a limit of 1.25 would still serve one run: it grows to 2, then 3...
        window(pace, clock, math.floor(pace.limit), [0.004] * 5)
        served.append(math.floor(pace.limit))
    assert served == [2, 3, 4]


def test_a_limit_the_worker_does_not_use_does_not_grow() -> None:
    clock = Clock()
    pace = Pace(8, clock=clock)
    for _ in range(10):
        window(pace, clock, 2, [0.004] * 5)
    assert pace.limit == START


def test_it_waits_for_enough_steps_to_tell_and_grows_when_none_came() -> None:
    clock = Clock()
    pace = Pace(4, clock=clock)
    window(pace, clock, START, [0.004] * 5)
    assert pace.baseline == pytest.approx(0.004)
    limit = pace.limit
    # Fewer than MIN_STEPS steps: no look yet, even slow ones.
    assert window(pace, clock, int(limit), [0.050] * (MIN_STEPS - 1)) == 0
    assert pace.limit == limit
    # A full window later they are enough, and they cost too much.
    window(pace, clock, int(limit), [0.050])
    assert pace.limit < limit
    # Runs waiting on slow model calls make no step: the pace grows.
    before = pace.limit
    window(pace, clock, int(pace.limit), [])
    assert pace.limit == pytest.approx(before * GROW)


def test_an_event_loop_that_runs_late_shrinks_it_with_steps_or_without() -> None:
    """A loop far behind makes few steps; a look with none must not read as runs waiting on a
    slow model."""
    clock = Clock()
    pace = Pace(4, clock=clock)
    window(pace, clock, START, [0.004] * 5)
    grown = pace.limit
    for _ in range(int(WINDOW / LAG_PROBE)):
        pace.lagged(LAG_LIMIT * 3)
    assert window(pace, clock, int(grown), []) == 0
    assert pace.limit == pytest.approx(grown * SHRINK)
    assert pace.lag == pytest.approx(LAG_LIMIT * 3)
    # On time again: a look with no step grows it, as before.
    for _ in range(int(WINDOW / LAG_PROBE)):
        pace.lagged(0.001)
    before = pace.limit
    window(pace, clock, int(pace.limit), [])
    assert pace.limit == pytest.approx(before * GROW)


def test_steps_that_cost_more_while_the_cpus_are_idle_do_not_shrink_it() -> None:
    """A step that took longer while a fifth of the machine's CPU time was idle waited for
    Redis, the model server or its loop's turn, not for a CPU: fewer runs would leave the CPUs
    idle while runs wait to start.  Once the CPUs are busy, the same steps shrink it."""
    clock = Clock()
    idle: list[float | None] = [0.9]
    pace = Pace(2, clock=clock, idle=lambda: idle[0])
    for _ in range(2):
        window(pace, clock, int(pace.limit), [0.004] * 5)
    grown = pace.limit
    for _ in range(3):  # two and a half times the baseline, the CPUs idle: it goes on growing
        window(pace, clock, int(pace.limit), [0.010] * 5)
    assert pace.limit > grown
    assert pace.idle == 0.9
    idle[0] = IDLE_ROOM / 2
    served = int(pace.limit)
    assert window(pace, clock, served, [0.010] * 5) == 0
    assert pace.limit == pytest.approx(served * SHRINK)
    idle[0] = None  # (unreadable: as busy)
    served = int(pace.limit)
    assert window(pace, clock, served, [0.010] * 5) == 0
    assert pace.limit == pytest.approx(served * SHRINK)


def test_the_idle_share_is_the_machines_or_a_containers_quotas(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 50 0 50 350 50 0 0 0 0 0\n")
    idle = MachineIdle(str(stat))
    assert idle() is None  # (no time passed)
    stat.write_text("cpu  150 0 150 1000 100 0 0 0 0 0\n")
    assert idle() == pytest.approx(300 / 400)
    assert MachineIdle(str(tmp_path / "missing"))() is None
    # A container limited to 1.5 CPUs that used 0.6 s of CPU in 1 s: 0.9 of its 1.5 left idle.
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "cpu.max").write_text("150000 100000\n")
    (cgroup / "cpu.stat").write_text("usage_usec 1000000\nuser_usec 800000\n")
    clock = Clock()
    limited = MachineIdle(str(stat), cgroup=str(cgroup), clock=clock)
    clock.now += 1.0
    (cgroup / "cpu.stat").write_text("usage_usec 1600000\nuser_usec 1300000\n")
    assert limited() == pytest.approx(0.9 / 1.5)
    (cgroup / "cpu.max").write_text("max 100000\n")  # no limit: the machine's
    assert MachineIdle(str(stat), cgroup=str(cgroup))._quota() is None
    if Path("/proc/stat").exists():
        real = MachineIdle(cgroup=own_cgroup())
        time.sleep(0.05)
        share = real()
        assert share is None or 0.0 <= share <= 1.0


# --- the role under a pace ----------------------------------------------------------------------


class Held(Pace):
    """A pace that never moves, which remembers the most runs it was told were served."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit
        self.most = 0

    def room(self, served: int) -> int:
        self.most = max(self.most, served)
        return max(0, int(self.limit) - served)


class Concurrency:
    """Model calls in flight at once, as the model server sees them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.sessions: set[str] = set()
        self.steps: dict[str, int] = {}

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        task = task_of(request)
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.sessions.add(task)
            step = self.steps[task] = self.steps.get(task, -1) + 1
        try:
            time.sleep(0.15)
        finally:
            with self.lock:
                self.now -= 1
        if step < 2:
            return {"tool_calls": [call("think", {"thought": f"{task} {step}"}, f"{task}-{step}")]}
        return finish(f"{task} done", f"{task}-{step}")


@pytest.fixture
def concurrency() -> Iterator[tuple[OpenAIServer, Concurrency]]:
    seen = Concurrency()
    with OpenAIServer(model="test-model") as server:
        server.respond(seen.answer, times=1000)
        yield server, seen


@pytest.fixture
def delegating() -> Iterator[OpenAIServer]:
    with OpenAIServer(model="test-model") as server:
        server.respond(script, times=1000)
        yield server


@pytest.mark.anyio
async def test_runs_past_a_workers_pace_wait_for_room_and_all_finish(
    bus: Bus, workspace: Path, concurrency: tuple[OpenAIServer, Concurrency]
) -> None:
    server, seen = concurrency
    pace = Held(2)
    names = [f"paced-{i}" for i in range(6)]
    async with roles(bus, workspace, server, pace=pace):
        for name in names:
            await open_run(bus, name, name, limits=RunLimits(max_steps=5))
        ends = [await run_end(bus, name, timeout=60) for name in names]
    assert all(isinstance(end, events.Finish) for end in ends), ends
    assert seen.sessions == set(names)
    assert seen.most <= 2, f"{seen.most} model calls at once on a worker with room for 2 runs"
    assert pace.most <= 2
    assert seen.most == 2  # (and it used the room it had)


@pytest.mark.anyio
async def test_a_parent_waiting_for_its_children_leaves_its_room_to_them(
    bus: Bus, workspace: Path, delegating: OpenAIServer
) -> None:
    pace = Held(1)
    async with roles(bus, workspace, delegating, pace=pace):
        await open_run(bus, "tree", "split tree 3", limits=RunLimits(max_steps=5))
        last = await run_end(bus, "tree", timeout=45)
    assert isinstance(last, events.Finish), last
    assert last.final_thought == "tree.0 done | tree.1 done | tree.2 done"
    assert pace.most <= 1  # one run served at a time: the children one after another

"""A sandbox's life and its share of the host: it lives as long as its session, has a uid,
a /tmp and a PATH of its own, and its workspace belongs to one log.

Each test runs a real runtime worker process (``tests/workerproc.py``) or a real
:class:`~riverbed.runtime.Runtime` with real bubblewrap sandboxes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from riverbed import events
from riverbed.agent.client import Bus
from riverbed.runtime.runtime import SANDBOX_PATH
from tests.workerproc import WorkerProcess

pytestmark = [pytest.mark.anyio]


@pytest.fixture
def worker(standalone_redis_url: str, prefix: str, workspace: Path, tmp_path: Path) -> Iterator[WorkerProcess]:
    proc = WorkerProcess(
        ["runtime"],
        name="lifer",
        redis_url=standalone_redis_url,
        prefix=prefix,
        workspace=workspace,
        lease=2.0,
        log_dir=tmp_path,
    )
    proc.wait_ready()
    yield proc
    proc.close()


async def sh(bus: Bus, session: str, command: str, timeout: float = 30) -> events.CmdOutput:
    action = events.CmdRun(command=command, timeout=timeout, blocking=True)
    out = await bus.session(session).act(action, timeout=timeout + 30)
    assert isinstance(out, events.CmdOutput), out
    return out


async def py(bus: Bus, session: str, code: str) -> events.PythonOutput:
    out = await bus.session(session).act(events.PythonRun(code=code), timeout=60)
    assert isinstance(out, events.PythonOutput), out
    return out


# --- 1. a sandbox lives as long as its session ------------------------------------------------------

#: anyio retires a worker thread idle for this long (``WorkerThread.MAX_IDLE_TIME``) when another
#: thread is handed work; a sandbox tied to such a thread died with it.
_ANYIO_IDLE = 10.0


@pytest.mark.fault
@pytest.mark.timeout(300)
async def test_sandboxes_started_together_outlive_the_threads_that_started_them(
    standalone_bus: Bus, worker: WorkerProcess
) -> None:
    bus = standalone_bus
    sessions = [f"many-{i}" for i in range(8)]
    mark = str(50_000 + int.from_bytes(os.urandom(2)))

    async def begin(i: int, session: str) -> None:
        out = await sh(bus, session, f"export KEPT=v{i}; sleep {mark} & echo started")
        assert "started" in out.content, out
        cell = await py(bus, session, f"kept = {i} * 6")
        assert cell.exception is None, cell

    async with anyio.create_task_group() as tg:  # started at once: one thread each, then idle
        for i, session in enumerate(sessions):
            tg.start_soon(begin, i, session)
    # Other work for three idle times over: every thread hop may retire the threads idle since.
    deadline = anyio.current_time() + 3 * _ANYIO_IDLE
    while anyio.current_time() < deadline:
        assert (await sh(bus, "busy", "echo ok")).content == "ok\n"
        await py(bus, "busy", "1")
        await anyio.sleep(0.5)
    for i, session in enumerate(sessions):
        out = await sh(bus, session, "echo $KEPT; jobs -r | wc -l")
        assert out.content == f"v{i}\n1\n", out
        cell = await py(bus, session, "kept")
        assert cell.result == str(i * 6), cell
        assert not cell.state_lost, cell


# --- 4. a fixed PATH ---------------------------------------------------------------------------------


@pytest.mark.security
async def test_the_workers_path_does_not_reach_its_sandboxes(
    standalone_redis_url: str, prefix: str, workspace: Path, tmp_path: Path, standalone_bus: Bus
) -> None:
    private = tmp_path / ("worker-only-" + os.urandom(4).hex())
    private.mkdir()
    proc = WorkerProcess(
        ["runtime"],
        name="pathy",
        redis_url=standalone_redis_url,
        prefix=prefix,
        workspace=workspace,
        extra_env={"PATH": f"{private}:{os.environ['PATH']}"},
        log_dir=tmp_path,
    )
    try:
        proc.wait_ready()
        shell = await sh(standalone_bus, "p", "echo $PATH")
        cell = await py(standalone_bus, "p", "import os; os.environ['PATH']")
    finally:
        proc.close()
    assert shell.content == f"{SANDBOX_PATH}\n"
    assert cell.result == repr(SANDBOX_PATH)
    assert private.name not in shell.content + (cell.result or "")
